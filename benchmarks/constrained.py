"""The cost of constrained tool calls (flywheel/policies/constrained.py): grammar compile time and the per-token
cost of a row's mask, on the tiny student's tokenizer and SmolLM2's (vocab 49,152).

    .venv/bin/python benchmarks/constrained.py [--walks 40] [--quick]

For the calculator's and the support desk's tools: `compile_ms` is the first row_constraints call for a tool set
(the grammar built; SmolLM2's first call also wraps its tokenizer, `smol_wrap_tokenizer_s`), `cached_us` a later
one. `masked_us_per_token` is allowed() + accept() per token while a call is written ("required"; a sampler
picks among the allowed tokens), `free_us_per_token` the same in free text ("auto", where allowed() is None).
SmolLM2's figures are null when its package (the smol extra) is not installed. The last line is one JSON object.
`--quick` runs 6 walks a case.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from flywheel.envs.calculator import CalculatorEnv
from flywheel.envs.support import make_env
from flywheel.policies import constrained
from flywheel.policies.constrained import row_constraints


def tokenizers() -> dict:
    """The tiny student's tokenizer (trained as tests/conftest.py trains it) and SmolLM2's, where installed."""
    from transformers import AutoTokenizer

    from flywheel.checkpoints import CheckpointError, gguf_file
    from flywheel.train.students import SMOLLM2
    from flywheel.train.tiny import environment_corpus, train_tokenizer

    found = {"tiny": train_tokenizer(environment_corpus(CalculatorEnv(), n=300, seed=0), 400)}
    try:
        file = gguf_file(SMOLLM2)
        found["smol"] = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except (CheckpointError, ImportError, ValueError):
        pass
    return found


def per_token_us(tokenizer, tools: list[dict], choice: str, walks: int, rng: random.Random) -> float:
    """Mean microseconds of allowed() + accept() per token over `walks` sampled rows (up to 200 tokens each)."""
    eos, spent, tokens = tokenizer.eos_token_id, 0.0, 0
    for row in row_constraints(tokenizer, tools, choice, walks, len(tokenizer)):
        for _ in range(200):
            started = time.perf_counter()
            mask = row.allowed()
            spent += time.perf_counter() - started
            if mask is None:
                token = rng.randrange(len(tokenizer)) if rng.random() > 0.02 else eos
            else:
                allowed = np.flatnonzero(mask.numpy())
                token = int(allowed[rng.randrange(len(allowed))])
            if token == eos:
                break
            started = time.perf_counter()
            row.accept(token)
            spent += time.perf_counter() - started
            tokens += 1
    return round(spent / max(tokens, 1) * 1e6, 1)


def measure(walks: int) -> dict:
    """Every figure, for the calculator's and the support desk's tools, on each tokenizer."""
    tool_sets = {"calculator": CalculatorEnv().tools(), "support": make_env().tools()}
    out: dict = {"library": "llguidance", "walks": walks}
    for name, tokenizer in {"smol": None, **tokenizers()}.items():
        for key in ("compile_ms", "cached_us", "masked_us_per_token", "free_us_per_token"):
            out[f"{name}_{key}"] = None if tokenizer is None else {}
        if tokenizer is None:
            out[f"{name}_wrap_tokenizer_s"] = None
            continue
        rng = random.Random(0)
        started = time.perf_counter()
        constrained._tokenizer_key(tokenizer)
        out[f"{name}_wrap_tokenizer_s"] = round(time.perf_counter() - started, 3)
        for env, tools in tool_sets.items():
            constrained._compiled.cache_clear()
            started = time.perf_counter()
            row_constraints(tokenizer, tools, "required", 1, len(tokenizer))
            out[f"{name}_compile_ms"][env] = round((time.perf_counter() - started) * 1e3, 2)
            started = time.perf_counter()
            row_constraints(tokenizer, tools, "required", 1, len(tokenizer))
            out[f"{name}_cached_us"][env] = round((time.perf_counter() - started) * 1e6, 1)
            out[f"{name}_masked_us_per_token"][env] = per_token_us(tokenizer, tools, "required", walks, rng)
            out[f"{name}_free_us_per_token"][env] = per_token_us(tokenizer, tools, "auto", walks, rng)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 walks a case (what the tests run)")
    parser.add_argument("--walks", type=int, default=40)
    args = parser.parse_args()
    print(json.dumps(measure(walks=6 if args.quick else args.walks)))


if __name__ == "__main__":
    main()
