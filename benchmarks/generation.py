"""Multi-turn generation on the support desk: the hf policy keeping each conversation's cache from one turn to the
next, against the same policy re-reading every turn whole, and against the old path (transformers' `generate`).

    .venv/bin/python benchmarks/generation.py [--smol] [--conversations 16] [--turns 5] [--repeats 2]
                                              [--threads 2] [--precision fp32] [--student PATH]
                                              [--copy-opening] [--quick]

The prompts are the oracle's support conversations of 4 or more assistant turns (its tool calls, the tools'
results), replayed turn by turn: at turn t every conversation that has a t-th assistant turn is one row of the
batch, its prompt the conversation up to that turn, so rows end at different turns and each turn's prompt extends
the last one by the oracle's answer and the tool results (what a model's own episode looks like to the policy,
whatever the model writes). Greedy, `rl.max_new_tokens` of the pipeline a turn, fp32 (`--precision bf16`:
under autocast, as support-smol's evaluate; there `same_rows_share` is the figure, see below).

- `kept`: HFPolicy as it is (a row's cache kept after its turn; the next turn reads only what is new).
- `reread`: the same policy with `kept_bytes=0` (every turn read whole, its shared opening once).
- `generate`: the policy's code before issue 47: transformers' `generate` on each turn's batch (the opening read
  once), every row riding along to the longest.

tokens/s = generated tokens / seconds over all turns; `kept_ratio` = kept / reread, `loop_ratio` = reread /
generate. `same_tokens`: kept and reread wrote exactly the same tokens (asserted in fp32); `generate_same_share`:
the share of rows where the old path wrote the same tokens too (fp32 ties may differ). Under bf16 the kept caches
are as faithful as bf16 itself: a batch laid out otherwise rounds otherwise, so a near-tie may flip, as it does
between two batch sizes with no kept cache at all; `same_rows_share` says how many rows were written alike.
`kept_read_share`: the prompt tokens the kept side read / all its prompt tokens; `row_steps_share`: the rows x
steps it computed / what rows riding along to their batch's longest would have. Each side keeps its best of
--repeats runs, alternating which goes first. Default: the tiny student of the `support` pipeline (random
weights, tokenizer trained on the desk's oracle conversations); `--smol`: SmolLM2-135M-Instruct of `support-smol`
with its compact tool template (needs `make smol-setup`). Both are untrained on the desk: their turns are what an
untrained model writes (SmolLM2's base 43 tokens a turn here, 64 at most). `--student PATH`: a trained checkpoint
of the pipeline's student instead (the sft or rl stage's model, or peer_rl.py's SFT student), whose turns end
where its tool call or answer does, as in RL and evaluate. The last line is one JSON object.
`--copy-opening`: the batch's shared opening (system prompt and tools) copied into every row's cache on the
kept and reread sides, as before it was held once (flywheel.policies.shared_prefix; `prefix_rows` counts the rows
read after one held once).
`--quick`: 4 conversations, 2 turns of 8 tokens, one run each side.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def conversations(cfg, n: int, min_turns: int) -> tuple[object, list[list[dict]]]:
    """The environment and n oracle conversations with at least min_turns assistant turns."""
    from flywheel.agent import Harness, Limits
    from flywheel.envs import load_environment
    from flywheel.policies.oracle import OraclePolicy

    env = load_environment(cfg.environment, ROOT)
    found: list[list[dict]] = []
    seed = 0
    while len(found) < n:
        tasks = list(islice(env.generate_tasks(seed), 200))
        episodes = Harness(env, Limits(max_turns=13)).run(OraclePolicy(env), tasks)
        found += [e.messages for e in episodes if sum(m["role"] == "assistant" for m in e.messages) >= min_turns]
        seed += 1
    return env, found[:n]


def turn_batches(convs: list[list[dict]], turns: int) -> list[list[list[dict]]]:
    """Per turn t, the prompts of the conversations that have a t-th assistant turn: everything before it."""
    batches = []
    for t in range(turns):
        prompts = []
        for conv in convs:
            at = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            if len(at) > t:
                prompts.append(conv[:at[t]])
        if prompts:
            batches.append(prompts)
    return batches


def run_policy(policy, batches, tools, sampling) -> tuple[list[list[int]], float]:
    """Every turn's batch through the policy: the tokens written, and the seconds taken."""
    tokens, started = [], time.perf_counter()
    for prompts in batches:
        tokens += [c.token_ids for c in policy.generate(prompts, tools, sampling)]
    return tokens, time.perf_counter() - started


def run_generate(model, tokenizer, batches, tools, max_new_tokens: int, precision: str) -> tuple[list[list[int]],
                                                                                                  float]:
    """The hf policy's generation before issue 47: one `generate` per turn's batch, its shared opening read once."""
    import torch

    from flywheel.policies.hf import SHARED_PREFIX_MIN, _common_prefix
    from flywheel.policies.toolcalls import canonical_messages

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    tokens, started = [], time.perf_counter()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for prompts in batches:
            rows = tokenizer.apply_chat_template([canonical_messages(p) for p in prompts], tools=tools,
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
            shared = _common_prefix(rows)
            head = rows[0][:shared] if len(rows) > 1 and shared >= SHARED_PREFIX_MIN else []
            rests = [r[len(head):] for r in rows]
            width = max(len(r) for r in rests)
            ids = torch.tensor([head + [pad] * (width - len(r)) + r for r in rests])
            mask = torch.tensor([[1] * len(head) + [0] * (width - len(r)) + [1] * len(r) for r in rests])
            cache = None
            if head:
                cache = model(input_ids=torch.tensor([head]), use_cache=True).cache
                cache.batch_repeat_interleave(len(rows))
            out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad, do_sample=False)
            for row in out[:, ids.shape[1]:].tolist():
                tokens.append(row[:row.index(eos) + 1] if eos in row else row)
    return tokens, time.perf_counter() - started


def student(cfg, smol: bool, folder: Path, trained: Path | None = None):
    """(model, tokenizer) of the pipeline's student: a trained checkpoint of it (with its own template), SmolLM2 with
    the pipeline's template, or a fresh tiny one."""
    from flywheel.checkpoints import load_student

    if trained is not None:
        return load_student(trained)
    if smol:
        model, tokenizer = load_student(cfg.student.model)
        tokenizer.chat_template = (ROOT / cfg.student.chat_template).read_text()
        return model, tokenizer
    from flywheel.envs import load_environment
    from flywheel.train.tiny import build_tiny_student, environment_corpus

    env = load_environment(cfg.environment, ROOT)
    return load_student(build_tiny_student(environment_corpus(env, n=300, seed=0), cfg.student.tiny, folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smol", action="store_true", help="SmolLM2-135M-Instruct (support-smol) instead of tiny")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5, help="assistant turns replayed (conversations have >= 4)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the stages use the machine's 2)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast, as support-smol's evaluate (same tokens then a share, not asserted)")
    parser.add_argument("--student", type=Path, help="a trained checkpoint of the pipeline's student (e.g. its "
                        "sft stage's model) instead of its untrained base")
    parser.add_argument("--copy-opening", action="store_true", help="the shared opening copied into every row "
                        "(HFPolicy(shared_prefix=False)), not held once for the batch")
    parser.add_argument("--quick", action="store_true", help="the same on tiny sizes (what the tests run)")
    args = parser.parse_args()

    import torch

    from flywheel.config import load_pipeline
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy

    torch.set_num_threads(args.threads)
    cfg = load_pipeline("support-smol" if args.smol else "support", ROOT / "pipelines.yaml")
    n, turns, repeats = (4, 2, 1) if args.quick else (args.conversations, args.turns, args.repeats)
    max_new = 8 if args.quick else cfg.rl.max_new_tokens
    env, convs = conversations(cfg, n, min_turns=4)
    batches = turn_batches(convs, turns)
    tools = env.tools()
    sampling = Sampling(temperature=0.0, max_new_tokens=max_new)
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = student(cfg, args.smol, Path(tmp) / "tiny", args.student)
    model.eval()
    precision = args.precision
    held = not args.copy_opening
    policies = {"kept": HFPolicy(model, tokenizer, batch_size=n, precision=precision, shared_prefix=held),
                "reread": HFPolicy(model, tokenizer, batch_size=n, precision=precision, kept_bytes=0,
                                   shared_prefix=held)}
    best: dict[str, float] = {}
    written: dict[str, list[list[int]]] = {}
    order = ["kept", "reread", "generate"]
    for repeat in range(repeats):
        for side in order if repeat % 2 == 0 else order[::-1]:
            if side == "generate":
                tokens, seconds = run_generate(model, tokenizer, batches, tools, max_new, precision)
            else:
                policies[side].forget()
                tokens, seconds = run_policy(policies[side], batches, tools, sampling)
            best[side] = min(best.get(side, float("inf")), seconds)
            written[side] = tokens
    same = [a == b for a, b in zip(written["kept"], written["reread"], strict=True)]
    # fp32: exactly the same turns. bf16 rounds a batch laid out otherwise otherwise, so near-ties may flip, as
    # they do between two batch sizes without any kept cache: there the share of rows written alike is the figure.
    assert precision == "bf16" or all(same), "the kept caches changed a turn"
    generated = sum(len(t) for t in written["kept"])
    rates = {side: generated / best[side] for side in ("kept", "reread")}
    rates["generate"] = sum(len(t) for t in written["generate"]) / best["generate"]
    stats = policies["kept"].stats
    result = {
        "student": "smol" if args.smol else "tiny", "trained": str(args.student) if args.student else None,
        "conversations": n, "turns": len(batches),
        "rows": sum(len(b) for b in batches), "max_new_tokens": max_new, "generated_tokens": generated,
        "kept_tokens_per_s": round(rates["kept"], 1), "reread_tokens_per_s": round(rates["reread"], 1),
        "generate_tokens_per_s": round(rates["generate"], 1),
        "kept_ratio": round(rates["kept"] / rates["reread"], 2),
        "loop_ratio": round(rates["reread"] / rates["generate"], 2), "same_tokens": all(same),
        "same_rows_share": round(sum(same) / len(same), 3),
        "generate_same_share": round(sum(a == b for a, b in zip(written["generate"], written["reread"], strict=True))
                                     / len(written["reread"]), 3),
        "kept_read_share": round(stats.read_tokens / (stats.read_tokens + stats.reused_tokens), 3),
        "row_steps_share": round(stats.row_steps / stats.ridealong_row_steps, 3),
        "seconds": {side: round(s, 2) for side, s in best.items()}, "threads": args.threads,
        "precision": precision, "shared_prefix": policies["kept"].shared_prefix, "prefix_rows": stats.prefix_rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
