"""The GPU paths, checked once on a machine with one CUDA GPU and no network (at most about 8 minutes).

    python benchmarks/gpu_check.py            # on a CUDA GPU
    python benchmarks/gpu_check.py --quick    # anywhere: tiny sizes on the CPU, seconds (the same code path)

Makes a random-weight Qwen2-architecture model here (its tokenizer trained on the calculator environment's
text, the project's chat template), then runs the project's own code on it: SFT full and LoRA (train_sft),
QLoRA where bitsandbytes is present, the RL loop with one actor process on the GPU (train_rl), and evaluation
(evaluate_model). Progress goes to stderr; the last line on stdout is one JSON object: tokens/s of each part
and the device it ran on (a part that could not run says why). Imports only torch, transformers, peft, trl (as
the project does) and the project, so it runs where only the training path is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from flywheel.agent import Harness, Limits
from flywheel.config import LoRAConfig, RLConfig, SFTConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.evaluate.runner import evaluate_model
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.rl.loop import train_rl
from flywheel.train.sft import train_sft
from flywheel.train.tiny import environment_corpus, train_tokenizer

# Sizes: a GPU run that finishes well inside 8 minutes on one GPU; --quick, seconds on a laptop CPU.
SIZES = {
    "gpu": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "conversations": 1024, "sft_steps": 60,
            "batch": 32, "max_length": 256, "rl_steps": 4, "tasks_per_step": 16, "group": 4, "new_tokens": 48,
            "eval_tasks": 256},
    "quick": {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "conversations": 24, "sft_steps": 3,
              "batch": 4, "max_length": 128, "rl_steps": 1, "tasks_per_step": 2, "group": 2, "new_tokens": 8,
              "eval_tasks": 8},
}


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def make_qwen2(folder: Path, size: dict, env: CalculatorEnv) -> Path:
    """A random-weight Qwen2 model with the project's tokenizer and chat template, saved as a checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(environment_corpus(env, n=300, seed=0), vocab_size=512)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv_heads"], max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    log(f"model: Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, random weights")
    return folder


def gpu_memory() -> dict:
    """Peak GPU memory of this process since the last call (0 on the CPU): proof that a part used the GPU."""
    if not torch.cuda.is_available():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"peak_gpu_gib": round(peak, 3)}


def sft_part(base: Path, rows: list[dict], out: Path, size: dict, device: str, lora: LoRAConfig | None) -> dict:
    cfg = SFTConfig(steps=size["sft_steps"], batch_size=size["batch"], lr=1e-3, warmup_steps=2,
                    max_length=size["max_length"], eval_fraction=0.0, log_every=max(size["sft_steps"] // 3, 1),
                    lora=lora)
    result = train_sft(base, rows, out, cfg, device=device)
    return {"tokens_per_s": round(result["tokens_per_s"], 1), "device": device, "steps": result["steps"],
            "seconds": round(result["runtime_s"], 2), **gpu_memory()}


def qlora_part(base: Path, rows: list[dict], out: Path, size: dict, device: str) -> dict:
    if device == "cpu":
        return {"skipped": "QLoRA needs a CUDA GPU", "device": device}
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"skipped": "bitsandbytes is not installed (the gpu extra brings it)", "device": device}
    return sft_part(base, rows, out, size, device, LoRAConfig(r=16, alpha=32, quantize="4bit"))


def rl_part(base: Path, env: CalculatorEnv, out: Path, size: dict, device: str) -> dict:
    tasks = list(itertools.islice(env.generate_tasks(1), 4 * size["tasks_per_step"]))
    cfg = RLConfig(steps=size["rl_steps"], tasks_per_step=size["tasks_per_step"], group_size=size["group"],
                   max_new_tokens=size["new_tokens"], minibatch_size=16, max_length=size["max_length"], lr=1e-5,
                   actors=1, actor_devices=[device], max_staleness=1, checkpoint_every=0)
    rows, summary = train_rl(base, Harness(env, Limits(max_turns=2)), tasks, cfg, out, device=device)
    tokens = sum(r["tokens"] for r in rows)
    return {"tokens_per_s": round(tokens / max(summary["steps_wall_s"], 1e-9), 1), "device": device,
            "actor_device": cfg.actor_devices[0], "steps": summary["steps"], "episodes": summary["episodes"],
            "seconds": round(summary["wall_time_s"], 2), **gpu_memory()}


def eval_part(model: Path, env: CalculatorEnv, size: dict, device: str) -> dict:
    tasks = list(itertools.islice(env.generate_tasks(2), size["eval_tasks"]))
    started = time.perf_counter()
    rows = evaluate_model(model, Harness(env, Limits(max_turns=2, tool_timeout_s=2.0)), tasks, "check", batch_size=64,
                          device=device).rows
    seconds = time.perf_counter() - started
    return {"tokens_per_s": round(sum(r["tokens"] for r in rows) / seconds, 1), "device": device,
            "episodes": len(rows), "seconds": round(seconds, 2), **gpu_memory()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU: the code path, in seconds")
    args = parser.parse_args()
    if not args.quick and not torch.cuda.is_available():
        sys.exit(f"benchmarks/gpu_check.py: no CUDA GPU is visible (torch {torch.__version__}, "
                 f"CUDA build {torch.version.cuda}); run it on a GPU machine, or pass --quick to run the same code "
                 "path on the CPU at tiny sizes")
    device = "cpu" if args.quick else "cuda"
    size = SIZES["quick" if args.quick else "gpu"]
    started = time.perf_counter()
    env = CalculatorEnv()
    report: dict = {"check": "gpu_check", "mode": "quick" if args.quick else "gpu",
                    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
                    "torch": torch.__version__, "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None}
    with tempfile.TemporaryDirectory(prefix="flywheel-gpu-check-") as tmp:
        work = Path(tmp)
        base = make_qwen2(work / "base", size, env)
        oracle = OraclePolicy(env)
        tasks = list(itertools.islice(env.generate_tasks(0), size["conversations"]))
        rows = [{"messages": e.messages, "tools": env.tools()} for e in Harness(env).run(oracle, tasks)]
        gpu_memory()
        parts = {
            "sft_full": lambda: sft_part(base, rows, work / "full" / "sft", size, device, None),
            "sft_lora": lambda: sft_part(base, rows, work / "lora" / "sft", size, device,
                                         LoRAConfig(r=16, alpha=32)),
            "sft_qlora": lambda: qlora_part(base, rows, work / "qlora" / "sft", size, device),
            "rl": lambda: rl_part(work / "full" / "sft", env, work / "rl" / "model", size, device),
            "evaluate": lambda: eval_part(work / "rl" / "model", env, size, device),
        }
        for name, part in parts.items():
            log(f"{name} ...")
            try:
                report[name] = part()
            except Exception as err:  # one broken part must not hide the others' figures
                report[name] = {"error": f"{type(err).__name__}: {err}"[:500], "device": device}
            log(f"{name}: {report[name]}")
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report), flush=True)
    if any("error" in v for v in report.values() if isinstance(v, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
