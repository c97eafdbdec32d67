"""Write tasks.jsonl: 96 requests (borrow a book on the shelf, borrow one that is out: a hold, renew a loan).

    python envs/library/make_tasks.py      # from the project root; the file is committed beside it
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from envs.library import books, loans  # noqa: E402

BORROW = ("Hi, I'd like to borrow \"{t}\".", "Could I check out \"{t}\" today?",
          "Do you have \"{t}\"? I want to take it home.")
RENEW = ("Can I renew \"{t}\"? I haven't finished it.", "I need \"{t}\" a bit longer, please renew it.")


def rows() -> list[dict]:
    rng, out = random.Random(3), []
    for i, (book, title, copies) in enumerate(books()):
        for k in range(2 if copies else 1):
            card = f"C-{3000 + rng.randrange(1000)}"
            kind = "borrow" if copies else "hold"
            out.append({"prompt": BORROW[(i + k) % len(BORROW)].format(t=title),
                        "answer": {"kind": kind, "book": book, "card": card}, "slice": kind})
    by_book = {b: t for b, t, _ in books()}
    for i, (book, card, _due) in enumerate(loans()):
        out.append({"prompt": RENEW[i % len(RENEW)].format(t=by_book[book]),
                    "answer": {"kind": "renew", "book": book, "card": card}, "slice": "renew"})
    for i, row in enumerate(out):
        row["split"] = "heldout" if i % 4 == 3 else "train"
    return out


if __name__ == "__main__":
    path = Path(__file__).parent / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"{path}: {len(rows())} tasks")
