"""SmolLM2-135M-Instruct on the support desk (the `support-smol` pipeline's student): its speed on a CPU, each part
measured side by side with the bare loop it stands in for.

    .venv/bin/python benchmarks/smol.py [--steps 6] [--tasks 16] [--repeats 2] [--quick]

Needs the smol extra (`make smol-setup`). On the oracle's support conversations, rendered as the pipeline renders
them (its compact tool template) and with its `sft` section (LoRA, its precision, its batch size):

- load: the GGUF file de-quantised into an empty cache (FLYWHEEL_GGUF_CACHE, a temporary folder here) and then
  loaded a second time from that cache (`load_first_s`, `load_cached_s`).
- SFT: (a) the stage, flywheel.train.sft.train_sft, for --steps steps (tokens/s of its steps, as its log reports
  them), against (b) a bare PyTorch loop: the same model and LoRA, the stage's own tokenized examples in batches
  of the same size padded to their longest, AdamW, forward and backward under the same autocast. `sft_ratio` =
  stage / bare; `padding_share` = padded positions / all positions of the bare batches (sorting by length would
  save at most that); `opening_read_once_share` = the share of the rows' tokens the stage does not read, because
  it reads a batch's shared opening (system prompt, tools) once for all its rows where the bare loop reads every
  row whole (the stage also runs the LM head only where a token is trained: both make it faster than the bare
  loop, the same loss). The bare loop runs again in fp32 on the same batches from the same start:
  `bf16_speedup` and the largest per-step loss difference (`bf16_max_loss_diff`); and in bf16 with one thread
  (`one_thread_tokens_per_s`) against two, the choice the stages make.
- generation: the trained student's greedy episodes on --tasks held-out tasks through the harness
  (flywheel.agent.Harness with the hf policy: template, parsing, tool calls, the next turn) against a bare
  `generate` loop over exactly the prompts the harness sent, turn by turn in the same batches. `generate_ratio` =
  harness / bare generated tokens per second.

Each side keeps its best of --repeats runs, alternating which goes first. The last line is one JSON object.
`--quick`: 1 step of one conversation cut at 384 tokens, 2 tasks of 2 turns of 16 tokens, one run each side, the
GGUF from the user's cache, loaded twice in one process (what the tests run: it checks that the benchmark works,
its figures mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from itertools import islice, pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = "support-smol"


def rows_and_tasks(cfg, conversations: int, tasks: int):
    """The oracle's train conversations (train seed) and held-out-style tasks (another seed) of the pipeline's env."""
    from flywheel.agent import Harness, Limits
    from flywheel.envs import load_environment
    from flywheel.policies.oracle import OraclePolicy

    env = load_environment(cfg.environment, ROOT)
    tasks_seen = list(islice(env.generate_tasks(0), conversations))
    episodes = Harness(env, Limits.from_config(cfg.environment)).run(OraclePolicy(env), tasks_seen)
    return env, [{"messages": e.messages, "tools": env.tools()} for e in episodes], \
        list(islice(env.generate_tasks(1), tasks))


LOAD = """
import sys, time
started = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from flywheel.checkpoints import load_student
imported = time.perf_counter()
for _ in range(int(sys.argv[2])):
    loading = time.perf_counter()
    model, _ = load_student(sys.argv[1])
    total = sum(float(p.float().sum()) for p in model.parameters())  # every weight read, not only mapped
    print(time.perf_counter() - loading, imported - started)
"""


def timed_load(student: str, cache: Path, one_process: bool = False) -> tuple[float, float]:
    """Seconds to load the GGUF, each time in a fresh process (every weight read; importing torch and transformers
    not counted), into an empty de-quantisation cache and then again from it; `one_process`: both loads in one."""
    import subprocess

    from flywheel.checkpoints import GGUF_CACHE_ENV

    env = os.environ | {GGUF_CACHE_ENV: str(cache)}
    seconds = []
    for _ in range(1 if one_process else 2):
        ran = subprocess.run([sys.executable, "-c", LOAD, student, "2" if one_process else "1"], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        seconds += [float(line.split()[0]) for line in ran.stdout.splitlines()]
    os.environ[GGUF_CACHE_ENV] = str(cache)  # the rest of the benchmark loads from the filled cache
    return seconds[0], seconds[1]


def stage(student: str, rows: list[dict], out: Path, sft, template: Path) -> dict:
    """flywheel's train_sft, logging every step: tokens/s of the steps after the first, as the bare loop counts
    (its log's per-step rate times the time between steps; the load and the save left out, checkpoints not)."""
    from flywheel.train.sft import train_sft

    logged: list[tuple[float, float]] = []
    started = time.perf_counter()
    result = train_sft(student, rows, out / "sft", sft.model_copy(update={"log_every": 1}), chat_template=template,
                       on_log=lambda step, m: logged.append((time.perf_counter(), m["tokens_per_s"])), device="cpu")
    steady = [(now - before) * rate for (before, _), (now, rate) in pairwise(logged)]
    seconds = logged[-1][0] - logged[0][0] if len(logged) > 1 else 0.0
    return {"tokens": result["tokens"], "tokens_per_s": sum(steady) / seconds if seconds else 0.0,
            "loss": result["train_loss"], "wall_s": time.perf_counter() - started}


def bare_batches(student: str, rows: list[dict], sft, template: Path) -> tuple[list, float, float]:
    """The stage's own tokenized examples, shuffled by its seed, in batches of its size padded to their longest;
    the share of padded positions, and the share of the rows' positions the stage reads once for a whole batch
    (the shared opening it does not read again for the other rows)."""
    import torch

    from flywheel.checkpoints import load_student
    from flywheel.train.opening import shared_opening
    from flywheel.train.sft import sft_records, tokenize_records

    _, tokenizer = load_student(student)
    text = template.read_text()
    examples = tokenize_records(tokenizer, sft_records(rows), sft, text).train
    random.Random(sft.seed).shuffle(examples)
    batches, padded, positions, once = [], 0, 0, 0
    for i in range(sft.steps):
        chunk = [examples[(i * sft.batch_size + j) % len(examples)] for j in range(sft.batch_size)]
        width = max(len(e["input_ids"]) for e in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id or 0)
        labels = torch.full((len(chunk), width), -100)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, example in enumerate(chunk):
            n = len(example["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = (torch.tensor(example["input_ids"]),
                                                            torch.tensor(example["labels"]), 1)
        batches.append((ids, labels, mask))
        padded, positions = padded + int((mask == 0).sum()), positions + mask.numel()
        once += shared_opening(ids, labels != -100, mask) * (len(chunk) - 1)
    return batches, padded / positions, once / (positions - padded)


def bare_loop(student: str, batches: list, sft, precision: str, threads: int) -> dict:
    """A plain PyTorch LoRA loop over the batches: tokens/s of the steps after the first, and each step's loss."""
    import torch
    from peft import LoraConfig, get_peft_model

    from flywheel.checkpoints import load_student

    torch.set_num_threads(threads)
    torch.manual_seed(sft.seed)
    model, _ = load_student(student)
    model = get_peft_model(model, LoraConfig(r=sft.lora.r, lora_alpha=sft.lora.alpha, lora_dropout=sft.lora.dropout,
                                             target_modules=sft.lora.target_modules, task_type="CAUSAL_LM"))
    model.train()
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=sft.lr)
    losses, tokens, started = [], 0, time.perf_counter()
    for step, (ids, labels, mask) in enumerate(batches):
        if step == 1:  # the first step warms the allocator and the kernels: timed from the second on
            tokens, started = 0, time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        losses.append(float(loss))
        tokens += int(mask.sum())
    seconds = time.perf_counter() - started
    torch.set_num_threads(2)
    return {"tokens_per_s": tokens / seconds if len(batches) > 1 else 0.0, "losses": losses}


def harness(env, model, tokenizer, tasks, max_new_tokens: int, max_turns: int):
    """Greedy episodes through the harness: generated tokens, seconds, and the prompts of every turn."""
    from flywheel.agent import Harness, Limits
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy

    policy = HFPolicy(model, tokenizer, batch_size=len(tasks))
    started = time.perf_counter()
    episodes = Harness(env, Limits(max_turns=max_turns)).run(policy, tasks,
                                                             sampling=Sampling(temperature=0.0,
                                                                               max_new_tokens=max_new_tokens))
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
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from flywheel.checkpoints import gguf_cache_dir, load_student
    from flywheel.config import load_pipeline
    from flywheel.policies.toolcalls import canonical_messages

    torch.set_num_threads(2)
    cfg = load_pipeline(PIPELINE, ROOT / "pipelines.yaml")
    sft = cfg.sft.model_copy(update={"steps": args.steps, "eval_fraction": 0.0, "warmup_steps": 0})
    if args.quick:  # one row of the conversation's first 384 tokens (the prompt and a first answer) a step
        sft = sft.model_copy(update={"steps": 1, "batch_size": 1, "max_length": 384,
                                     "long_conversations": "truncate"})
    tasks, repeats = (2, 1) if args.quick else (args.tasks, args.repeats)
    template = ROOT / cfg.student.chat_template
    student = cfg.student.model
    env, rows, tasks = rows_and_tasks(cfg, sft.steps * sft.batch_size, tasks)
    with tempfile.TemporaryDirectory(prefix="bench-smol-") as tmp:
        # --quick loads from the user's cache (filled once): a fresh de-quantisation is the full form's figure
        cache = gguf_cache_dir() if args.quick else Path(tmp) / "gguf-cache"
        load_first, load_cached = timed_load(student, cache, one_process=args.quick)
        print(f"load: {load_first:.1f}s into an empty cache, {load_cached:.1f}s from it", flush=True)
        batches, padding, opening = bare_batches(student, rows, sft, template)
        best = {"stage": 0.0, "bare": 0.0}
        losses = {}
        for i in range(repeats):
            for name in ("bare", "stage") if i % 2 == 0 else ("stage", "bare"):  # neither always goes first
                if name == "stage":
                    result = stage(student, rows, Path(tmp) / f"stage-{i}", sft, template)
                else:
                    result = bare_loop(student, batches, sft, sft.precision, threads=2)
                    losses[sft.precision] = result["losses"]
                best[name] = max(best[name], result["tokens_per_s"])
                print(f"sft {name:5s} run {i}: {result['tokens_per_s']:.1f} tokens/s", flush=True)
        other = "fp32" if sft.precision == "bf16" else "bf16"
        contrast = bare_loop(student, batches, sft, other, threads=2)
        losses[other] = contrast["losses"]
        one_thread = bare_loop(student, batches, sft, sft.precision, threads=1)
        print(f"sft bare {other}: {contrast['tokens_per_s']:.1f} tokens/s; {sft.precision} on one thread: "
              f"{one_thread['tokens_per_s']:.1f}; losses bf16 {losses['bf16']} fp32 {losses['fp32']}", flush=True)

        model, tokenizer = load_student(Path(tmp) / "stage-0" / "sft")
        max_new, turns_cap = (16, 2) if args.quick else (cfg.rl.max_new_tokens, cfg.environment.max_turns)
        harness(env, model, tokenizer, tasks[:2], max_new, turns_cap)  # warm-up: the first calls are slower
        gen = {"harness": 0.0, "bare": 0.0}
        for i in range(repeats):
            n, seconds, turns, episodes = harness(env, model, tokenizer, tasks, max_new, turns_cap)
            gen["harness"] = max(gen["harness"], n / seconds)
            prompts = [[canonical_messages(m) for m in turn] for turn in turns]
            bare_n, bare_s = bare_generate(model, tokenizer, env.tools(), prompts, max_new)
            gen["bare"] = max(gen["bare"], bare_n / bare_s)
            print(f"generate run {i}: harness {n} tokens in {seconds:.1f}s, bare {bare_n} tokens in {bare_s:.1f}s; "
                  f"passed {sum(e.passed for e in episodes)}/{len(episodes)}", flush=True)
    bf16, fp32 = (best["bare"], contrast["tokens_per_s"]) if sft.precision == "bf16" else \
        (contrast["tokens_per_s"], best["bare"])
    print(json.dumps({
        "benchmark": "smol", "pipeline": PIPELINE, "steps": sft.steps, "batch_size": sft.batch_size,
        "precision": sft.precision, "stage_tokens_per_s": round(best["stage"], 1),
        "bare_torch_tokens_per_s": round(best["bare"], 1), "sft_ratio": round(best["stage"] / best["bare"], 3)
        if best["bare"] else None, "padding_share": round(padding, 3), "opening_read_once_share": round(opening, 3),
        "bf16_speedup": round(bf16 / fp32, 2) if fp32 else None,
        "bf16_max_loss_diff": round(max(abs(a - b) for a, b in zip(losses["bf16"], losses["fp32"], strict=True)), 4),
        "one_thread_tokens_per_s": round(one_thread["tokens_per_s"], 1),
        "load_first_s": round(load_first, 1), "load_cached_s": round(load_cached, 2),
        "harness_tokens_per_s": round(gen["harness"], 1), "bare_generate_tokens_per_s": round(gen["bare"], 1),
        "generate_ratio": round(gen["harness"] / gen["bare"], 3)}))


if __name__ == "__main__":
    main()
