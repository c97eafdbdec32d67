"""The SFT stage's own overhead: train_sft against a bare TRL SFTTrainer script, same model, data and steps.

    .venv/bin/python benchmarks/sft.py [--steps 60] [--conversations 500] [--repeats 4] [--quick]

Builds the demo's tiny student (pipelines.yaml's student.tiny) on oracle calculator conversations, then times,
alternating and keeping each one's best (the process's first run also pays one-time warm-up, so each
side needs a second run at least), (a) flywheel.train.sft.train_sft (template resolution, pre-tokenised
assistant-only labels, length rule, resume fingerprint, checkpoints, per-step callback, save) and (b) the
smallest TRL script that trains the same thing (assistant_only_loss on the messages, no checkpoints). Both are
timed end to end, loading to saved model, and count the same non-padding tokens. The held-out eval is off in
(a): it is extra work, not overhead. The last line is one JSON object; ratio = stage / bare tokens per second.
`--quick`: 4 steps on 64 conversations, one run each side.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from itertools import islice
from pathlib import Path

from flywheel.agent import Harness
from flywheel.config import load_pipeline
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.sft import train_sft
from flywheel.train.tiny import build_tiny_student, render_conversation

ROOT = Path(__file__).resolve().parents[1]


def bare_trl(base: Path, rows: list[dict], out: Path, sft) -> tuple[int, float]:
    """The plain TRL recipe: tokens trained and wall seconds, from loading the model to saving it."""
    started = time.perf_counter()
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = datasets.Dataset.from_list([{"messages": r["messages"], "tools": json.dumps(r["tools"])} for r in rows])
    args = SFTConfig(output_dir=str(out / "checkpoints"), max_steps=sft.steps,
                     per_device_train_batch_size=sft.batch_size, learning_rate=sft.lr, lr_scheduler_type="cosine",
                     warmup_steps=sft.warmup_steps, seed=sft.seed,
                     max_length=sft.max_length, assistant_only_loss=True, use_cpu=True, bf16=False,
                     gradient_checkpointing=False, activation_checkpointing=False, save_strategy="no",
                     report_to="none", disable_tqdm=True, include_num_input_tokens_seen="non_padding",
                     logging_steps=sft.log_every)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # as the stage does: no per-step printing in either
    trainer.train()
    trainer.save_model(str(out / "model"))
    return int(trainer.state.num_input_tokens_seen), time.perf_counter() - started


def stage(base: Path, rows: list[dict], out: Path, sft) -> tuple[int, float]:
    """flywheel's train_sft: tokens trained and wall seconds for the whole call."""
    started = time.perf_counter()
    result = train_sft(base, rows, out / "sft", sft.model_copy(update={"eval_fraction": 0.0}),
                       on_log=lambda step, metrics: None)
    return result["tokens"], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="demo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--conversations", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.conversations, args.repeats = min(args.steps, 4), min(args.conversations, 64), 1

    cfg = load_pipeline(args.pipeline, ROOT / "pipelines.yaml")
    sft = cfg.sft.model_copy(update={"steps": args.steps})
    env = CalculatorEnv()
    episodes = Harness(env).run(OraclePolicy(env), list(islice(env.generate_tasks(0), args.conversations)))
    rows = [{"messages": e.messages, "tools": env.tools()} for e in episodes]
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        base = build_tiny_student([render_conversation(r["messages"], r["tools"]) for r in rows], cfg.student.tiny,
                                  Path(tmp) / "base")
        best = {"stage": 0.0, "bare": 0.0}
        tokens = {}
        for i in range(args.repeats):
            order = (("bare", bare_trl), ("stage", stage))
            for name, run in order if i % 2 == 0 else order[::-1]:  # neither always goes first
                n, seconds = run(base, rows, Path(tmp) / f"{name}-{i}", sft)
                tokens[name] = n
                best[name] = max(best[name], n / seconds)
                print(f"{name:5s} run {i}: {n} tokens in {seconds:.2f}s = {n / seconds:.0f} tokens/s", flush=True)
    if tokens["stage"] != tokens["bare"]:
        print(f"note: token counts differ (stage {tokens['stage']}, bare {tokens['bare']})")
    print(json.dumps({"benchmark": "sft", "steps": args.steps, "batch_size": sft.batch_size,
                      "tokens": tokens["stage"], "stage_tokens_per_s": round(best["stage"], 1),
                      "bare_trl_tokens_per_s": round(best["bare"], 1),
                      "ratio": round(best["stage"] / best["bare"], 3)}))


if __name__ == "__main__":
    main()
