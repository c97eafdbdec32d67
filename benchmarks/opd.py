"""Does on-policy distillation pay? Held-out success after SFT, SFT+RL and SFT+OPD per seed, at their compute.

    .venv/bin/python benchmarks/opd.py [--pipeline rl-lift] [--seeds 3 4 5] [--arms sft rl opd]
                                       [--opd-steps N] [--opd-lr X] [--opd-tasks N] [--opd-group N]
                                       [--kl-coef X] [--objective opd|reward+opd]
                                       [--divergence sampled|reverse|forward] [--workdir DIR] [--quick]

The pipeline's loop without orchestration, per seed, as benchmarks/rl_gain.py runs it: the tiny student built
(seeded), the pipeline's imperfect teacher synthesising SFT data, SFT; then from the SFT checkpoint the
pipeline's RL (its rl section as shipped) and on-policy distillation (the same rl section with the objective
`opd` and the OPD settings below), each scored greedily on the same held-out tasks. The OPD teacher is a
stronger checkpoint with the student's tokenizer, built once: the student's architecture trained longer
(`--teacher-steps`, against SFT's 600) on conversations of a correct oracle over the train tasks (never the
held-out ones), where the student's SFT data comes from a teacher wrong on 95% of `big` answers.
Per seed one JSON line: each arm's held-out pass rate and per slice, OPD - SFT and OPD - RL paired per task with
the gate's bootstrap interval, each arm's student compute (episodes generated, tokens generated, tokens in the
loss, learner wall time); then a summary line. A `--workdir` keeps the teacher and each seed's SFT checkpoint,
so trying another OPD setting reuses them. `--quick`: tiny sizes (what a test can run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from itertools import islice
from pathlib import Path

import numpy as np
from _scratch import scratch
from rl_gain import by_slice, scores  # benchmarks/ is the script's folder, first on sys.path
from transformers.utils import logging as hf_logging

from flywheel.agent import Harness, Limits
from flywheel.config import OPDConfig, RLConfig, TinyModelConfig, load_pipeline
from flywheel.envs import load_environment
from flywheel.evaluate.stats import paired_bootstrap
from flywheel.policies.base import Sampling
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.rl.loop import train_rl
from flywheel.train.rl.monitor import Monitor, audit_sample
from flywheel.train.sft import train_sft
from flywheel.train.tiny import build_tiny_student, environment_corpus

ROOT = Path(__file__).resolve().parents[1]
DONE = "benchmark-done.json"  # beside a checkpoint this benchmark built: reuse it


def built(folder: Path, build) -> dict:
    """build(folder) once: its record is kept beside the checkpoint, and a later call reads it instead."""
    record = folder / DONE
    if record.exists():
        return json.loads(record.read_text())
    started = time.perf_counter()
    info = build(folder) or {}
    info["build_s"] = round(time.perf_counter() - started, 1)
    record.write_text(json.dumps(info))
    return info


def build_teacher(folder: Path, pipeline, env, train, corpus: list[str], steps: int) -> dict:
    """The OPD teacher: the student's architecture and tokenizer, SFT longer on a correct oracle's conversations."""
    tiny = pipeline.student.tiny
    base = build_tiny_student(corpus, TinyModelConfig(hidden_size=tiny.hidden_size, layers=tiny.layers,
                                                      heads=tiny.heads, vocab_size=tiny.vocab_size, seed=1234),
                              folder.parent / "teacher-base")
    episodes = Harness(env, Limits.from_config(pipeline.environment)).run(OraclePolicy(env), train,
                                                                          sampling=Sampling())
    rows = [{"messages": e.messages, "tools": env.tools()} for e in episodes if e.passed]
    train_sft(base, rows, folder, pipeline.sft.model_copy(update={"steps": steps, "seed": 1234}))
    return {"conversations": len(rows)}


def build_sft(folder: Path, pipeline, env, train, corpus: list[str], seed: int) -> dict:
    """The seed's base student and its SFT on the pipeline's imperfect teacher (rejection-sampled)."""
    cfg = pipeline
    base = build_tiny_student(corpus, cfg.student.tiny.model_copy(update={"seed": seed}), folder.parent / "base")
    teacher = OraclePolicy(env, error_rate=cfg.teacher.error_rate, error_slices=cfg.teacher.error_slices,
                           error_seed=cfg.teacher.error_seed)
    episodes = Harness(env, Limits.from_config(cfg.environment)).run(teacher, train,
                                                                     samples=cfg.synthesize.samples_per_task,
                                                                     sampling=Sampling())
    rows = [{"messages": e.messages, "tools": env.tools()} for e in episodes if e.passed]
    train_sft(base, rows, folder, cfg.sft.model_copy(update={"seed": seed}))
    return {"conversations": len(rows), "teacher_pass_rate": round(float(np.mean([e.passed for e in episodes])), 4)}


def improve(pipeline, env, train, heldout, sft: Path, out: Path, rl_cfg) -> dict:
    """RL or OPD from the SFT checkpoint into `out`: its summary's compute figures."""
    harness = Harness(env, Limits.from_config(pipeline.environment))
    monitor = Monitor(harness, audit_sample(heldout, rl_cfg.monitor_tasks), rl_cfg) if rl_cfg.monitor_every else None
    started = time.perf_counter()
    curve = []  # rl.keep_best's validation pass rate at each check: where a run that keeps version 0 went

    def on_step(step: int, metrics: dict) -> None:
        if "validation_pass" in metrics:
            curve.append([step + 1, round(metrics["validation_pass"], 4)])
    rows, summary = train_rl(sft, harness, train, rl_cfg, out, monitor=monitor,
                             checkpoint_dir=out.parent / f"{out.name}-checkpoints", on_step=on_step)
    return {"wall_s": round(time.perf_counter() - started, 1), "episodes": len(rows),
            "generated_tokens": int(summary.get("generated_tokens", 0)),
            "trained_tokens": int(summary.get("trained_tokens", 0)), "updates": int(summary.get("updates", 0)),
            "reward_hacking": summary.get("reward_hacking"),
            **{k: round(float(summary[k]), 4) for k in ("teacher_kl_first", "teacher_kl_last",
                                                        "teacher_divergence_first", "teacher_divergence_last",
                                                        "validation_pass_first", "validation_pass_best")
               if k in summary},
            **({"best_version": summary["best_version"], "validation_curve": curve} if "best_version" in summary
               else {})}


def interval(a: dict[str, float], b: dict[str, float], confidence: float) -> list[float]:
    ids = sorted(a)
    diff = paired_bootstrap([a[i] for i in ids], [b[i] for i in ids], n=2000, alpha=1 - confidence, seed=0)
    return [round(diff.estimate, 4), round(diff.low, 4), round(diff.high, 4)]


def one_seed(pipeline, opd_rl, env, train, heldout, corpus, seed: int, workdir: Path, teacher: Path,
             arms: list[str]) -> dict:
    """The arms for one seed; the numbers of its JSON line."""
    max_turns = pipeline.environment.max_turns
    sft_dir = workdir / "sft"
    sft_info = built(sft_dir, lambda f: build_sft(f, pipeline, env, train, corpus, seed))
    line = {"benchmark": "opd", "seed": seed, "heldout_tasks": len(heldout), "sft_conversations":
            sft_info["conversations"], "sft_build_s": sft_info["build_s"]}
    result = {"sft": scores(env, sft_dir, heldout, max_turns)}
    for arm in [a for a in arms if a != "sft"]:
        cfg = (pipeline.rl if arm == "rl" else opd_rl).model_copy(update={"seed": seed, "checkpoint_every": 0})
        if arm == "opd":
            cfg = RLConfig.model_validate(cfg.model_dump()
                                          | {"opd": cfg.objective.opd.model_copy(update={"teacher": str(teacher)})})
        # one folder per configuration: another OPD setting trains anew, the same one is reused
        out = workdir / f"{arm}-{hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:8]}"
        line[f"{arm}_compute"] = built(out, lambda f, cfg=cfg: improve(pipeline, env, train, heldout, sft_dir, f, cfg))
        result[arm] = scores(env, out, heldout, max_turns)
    confidence = pipeline.gate.confidence
    line |= {f"{arm}_success": round(float(np.mean(list(r.values()))), 4) for arm, r in result.items()}
    line |= {f"{arm}_by_slice": by_slice(r, heldout) for arm, r in result.items()}
    if "opd" in result:
        line["opd_minus_sft"] = interval(result["opd"], result["sft"], confidence)
    if "rl" in result:
        line["rl_minus_sft"] = interval(result["rl"], result["sft"], confidence)
    if "opd" in result and "rl" in result:
        line["opd_minus_rl"] = interval(result["opd"], result["rl"], confidence)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="rl-lift")
    parser.add_argument("--config", default=str(ROOT / "pipelines.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5])
    parser.add_argument("--arms", nargs="+", choices=["sft", "rl", "opd"], default=["sft", "rl", "opd"])
    # the OPD run: the pipeline's rl section with these changes (chosen on seeds 0-2: see docs/rl.md)
    parser.add_argument("--objective", choices=["opd", "reward+opd"], default="reward+opd")
    parser.add_argument("--opd-steps", type=int, default=100)
    parser.add_argument("--opd-lr", type=float, default=3e-4)
    parser.add_argument("--opd-tasks", type=int, default=24, help="tasks per step")
    parser.add_argument("--opd-group", type=int, default=4, help="samples per task")
    parser.add_argument("--kl-coef", type=float, default=1.0)
    parser.add_argument("--divergence", choices=["sampled", "reverse", "forward"], default="reverse",
                        help="rl.opd.divergence: sampled (an advantage per token) or exact over the vocabulary")
    parser.add_argument("--teacher-steps", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, help="where models go and are reused (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: 5 SFT steps, 2 RL/OPD steps, 48 tasks")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    pipeline = load_pipeline(args.pipeline, args.config)
    opd = {"steps": args.opd_steps, "lr": args.opd_lr, "tasks_per_step": args.opd_tasks,
           "group_size": args.opd_group, "objective": args.objective, "difficulty_filter": False,
           "opd": OPDConfig(teacher="(built below)", kl_coef=args.kl_coef, divergence=args.divergence)}
    teacher_steps, n_train, n_heldout = args.teacher_steps, pipeline.environment.train_tasks, \
        pipeline.environment.heldout_tasks
    if args.quick:
        small = {"steps": 2, "tasks_per_step": 4, "monitor_tasks": 4, "validate_every": 1, "validate_tasks": 4}
        pipeline = pipeline.model_copy(update={"sft": pipeline.sft.model_copy(update={"steps": 5, "log_every": 1}),
                                               "rl": pipeline.rl.model_copy(update=small)})
        opd |= small
        teacher_steps, n_train, n_heldout = 5, 32, 16
    opd_rl = RLConfig.model_validate(pipeline.rl.model_dump() | opd)  # validated: the objective holds rl.opd
    env = load_environment(pipeline.environment, ROOT)
    seed = pipeline.environment.seed
    train = list(islice(env.generate_tasks(seed), n_train))
    seen = {t.task_id for t in train}
    heldout = list(islice((t for t in env.generate_tasks(seed + 1_000_003) if t.task_id not in seen), n_heldout))
    corpus = environment_corpus(env, n=1000, seed=seed + 7)
    workdir = scratch("opd-", args.workdir)
    teacher = workdir / "teacher"
    if "opd" in args.arms:
        info = built(teacher, lambda f: build_teacher(f, pipeline, env, train, corpus, teacher_steps))
        if "heldout_success" not in info:
            info["heldout_success"] = round(float(np.mean(list(scores(env, teacher, heldout,
                                                                      pipeline.environment.max_turns).values()))), 4)
            (teacher / DONE).write_text(json.dumps(info))
        print(json.dumps({"benchmark": "opd", "teacher": str(teacher), "teacher_heldout_success":
                          info["heldout_success"], "teacher_conversations": info["conversations"],
                          "teacher_build_s": info["build_s"],
                          "opd_config": opd_rl.model_dump(include={"objective", "steps", "lr", "tasks_per_step",
                                                                   "group_size", "epochs_per_batch", "temperature",
                                                                   "keep_best"})
                          | {"kl_coef": args.kl_coef, "divergence": args.divergence}}),
              flush=True)

    lines = []
    for s in args.seeds:
        line = one_seed(pipeline, opd_rl, env, train, heldout, corpus, s, workdir / f"seed-{s}", teacher,
                        args.arms)
        print(json.dumps(line), flush=True)
        lines.append(line)
    summary = {"benchmark": "opd", "pipeline": args.pipeline, "seeds": args.seeds,
               **{f"{arm}_success": [x[f"{arm}_success"] for x in lines] for arm in args.arms}}
    for arm in [a for a in args.arms if a != "sft"]:
        summary[f"{arm}_minus_sft_lower"] = [x[f"{arm}_minus_sft"][1] for x in lines]
        summary[f"{arm}_lift_shown"] = sum(x[f"{arm}_minus_sft"][1] > 0 for x in lines)
        for key in ("episodes", "generated_tokens", "trained_tokens", "wall_s"):
            summary[f"{arm}_{key}"] = [x[f"{arm}_compute"][key] for x in lines]
    if "opd" in args.arms and "rl" in args.arms:
        summary["opd_minus_rl"] = [x["opd_minus_rl"] for x in lines]
        # OPD's student compute as a share of RL's: tokens the student generated, tokens in its loss
        summary["opd_to_rl_generated_tokens"] = round(sum(summary["opd_generated_tokens"])
                                                      / max(sum(summary["rl_generated_tokens"]), 1), 3)
        summary["opd_to_rl_trained_tokens"] = round(sum(summary["opd_trained_tokens"])
                                                    / max(sum(summary["rl_trained_tokens"]), 1), 3)
        summary["opd_to_rl_wall"] = round(sum(summary["opd_wall_s"]) / max(sum(summary["rl_wall_s"]), 1e-9), 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
