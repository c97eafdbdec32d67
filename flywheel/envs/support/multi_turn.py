"""The desk's multi_turn mode: the customer's first message leaves something out, and the customer gives it only
when asked (`environment: {name: support, args: {mode: multi_turn}}`).

A task's answer holds the whole conversation the customer will have: what they hold back and give when asked
(`withheld`: their email, or the order id), whether they wait to be asked before a write is confirmed
(`asks_confirm`), and, on some tasks, the other wish they turn to when asked to confirm (`mind`). The customer is
a script over that answer (`customer`, no model): the same conversation for the same agent, every run. It ends
with ###STOP### when the agent has answered and asks nothing it can give.

    slice          first message                                  the customer then
    ask_email      the request and the order, no email            gives the email when asked for it
    ask_order      the request and the email, no order id         gives the order id when asked (a one-order user)
    confirm        a write the policy allows, not confirmed       says "I confirm." when asked to confirm
    changes_mind   a hesitant write ("I'm thinking of ...")       asks for another thing when asked to confirm
    lookup         a whole question                               stops at the answer
    refuse         a whole request the policy refuses             stops at the answer

The rubric scores the conversation as a whole: the default mode's parts on the final database and answer (the
customer's last wish), and `asked`: the agent used a held-back detail only after the customer gave it, and wrote
only after the customer confirmed. Every answer depends on the first message alone (an ask_order task's user has
one order; a changes_mind opening is worded apart), so a task's id, its prompt's hash, says what it is: generated
tasks are written as text and read back by `task_from_opening`, which reads a recorded conversation too.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Iterator

from flywheel.contract import STOP, Task, prompt_hash
from flywheel.envs.support.db import SPEEDS
from flywheel.envs.support.rubric import resolved
from flywheel.envs.support.solver import _say, _text, answer_request
from flywheel.envs.support.tasks import (
    CONFIRM,
    EMAIL,
    GREETINGS,
    INTENTS,
    ORDER,
    POLICY,
    REQUESTS,
    _directory,
    _read,
    plan,
)

POLICY_MT = POLICY + " Missing email or order id: ask for it."
SLICES = {"ask_email": 0.2, "ask_order": 0.2, "confirm": 0.15, "changes_mind": 0.15, "lookup": 0.1, "refuse": 0.2}
WRITE_KINDS = ("cancel", "modify", "refund")
HELLO = ["Hi.", "Hello.", "Hi there."]
# a request about "my order", with no id (ask_order)
VAGUE = {"lookup": ["Where is my order?", "What is the status of my order?"],
         "cancel": ["Please cancel my order.", "I want to cancel my order."],
         "modify": ["Please switch my order to {speed} shipping.", "I'd like {speed} shipping for my order."],
         "refund": ["I want a refund for my order.", "Please refund my order."],
         "transfer": ["My order arrived damaged.", "My order never arrived."]}
# a write the customer is not sure of (changes_mind): worded unlike REQUESTS, so the opening says which slice
HESITANT = {"cancel": ["I'm thinking of cancelling order {oid}.", "Maybe cancel order {oid}? Not sure yet."],
            "modify": ["I'm thinking of {speed} shipping for order {oid}.",
                       "Maybe switch order {oid} to {speed} shipping? Not sure yet."],
            "refund": ["I'm thinking of a refund for order {oid}.", "Maybe refund order {oid}? Not sure yet."]}
HESITANT_WORDS = re.compile(r"thinking of|not sure yet", re.IGNORECASE)
ASK = {"email": "your email", "order": "the order id"}
MAX_USER_TURNS = 5


# --- the tasks ---------------------------------------------------------------------------------------------------

def generate(seed: int, db_seed: int, env: str = "support") -> Iterator[Task]:
    """An endless seeded stream of multi-turn tasks, slices in the shares of SLICES."""
    rng = random.Random(f"support-mt:{seed}")
    users, orders = _directory(db_seed)
    owned: dict[str, list[str]] = {}
    for oid, row in sorted(orders.items()):
        owned.setdefault(row[1], []).append(oid)
    emails = sorted(users)
    single = sorted(e for e in emails if len(owned.get(users[e], [])) == 1)
    all_orders = sorted(orders)
    slices, weights = list(SLICES), list(SLICES.values())
    while True:
        wanted = rng.choices(slices, weights)[0]
        for _ in range(200):
            email = rng.choice(single if wanted == "ask_order" else emails)
            mine = owned.get(users[email], [])
            oid = rng.choice(all_orders) if wanted == "refuse" and rng.random() < 0.4 else rng.choice(mine)
            task = _draw(rng, wanted, email, oid, db_seed, env)
            if task is not None:
                yield task
                break


def _draw(rng: random.Random, wanted: str, email: str, oid: str, db_seed: int, env: str) -> Task | None:
    """A first message of slice `wanted` about `email` and `oid`, read back as a recorded one is; None when the
    policy's outcome does not fit the slice."""
    kind = {"lookup": "lookup", "confirm": rng.choice(WRITE_KINDS), "changes_mind": rng.choice(WRITE_KINDS)}.get(
        wanted, rng.choice([*WRITE_KINDS, "lookup", "transfer"]))
    speed = rng.choice(SPEEDS)
    done = " I confirm." if kind in WRITE_KINDS and wanted not in ("confirm", "changes_mind") and \
        rng.random() < 0.5 else ""
    if wanted == "ask_email":
        text = f"{rng.choice(HELLO)} {rng.choice(REQUESTS[kind]).format(oid=oid, speed=speed)}{done}"
    elif wanted == "ask_order":
        text = _greet(rng, email) + rng.choice(VAGUE[kind]).format(speed=speed) + done
    elif wanted == "changes_mind":
        text = _greet(rng, email) + rng.choice(HESITANT[kind]).format(oid=oid, speed=speed)
    else:
        text = _greet(rng, email) + rng.choice(REQUESTS[kind]).format(oid=oid, speed=speed) + done
    task = task_from_opening(text, db_seed, env)
    return task if task is not None and task.slice == wanted else None


def task_from_opening(text: str, db_seed: int, env: str = "support") -> Task | None:
    """The multi-turn task a customer's first message opens, or None when the desk cannot verify it.

    A missing email is the order's owner's; a missing order id the customer's one order (none when they have more);
    a hesitant write ("I'm thinking of ...", "Not sure yet") is a customer who will change their mind."""
    users, orders = _directory(db_seed)
    found_email, found_order = EMAIL.search(text), ORDER.search(text)
    email = found_email.group().lower().rstrip(".") if found_email else None
    oid = found_order.group() if found_order else None
    withheld: dict[str, str] = {}
    if email is None and oid in orders:
        email = next(e for e, user_id in users.items() if user_id == orders[oid][1])
        withheld = {"email": email}
    elif oid is None and email in users:
        mine = [o for o, row in orders.items() if row[1] == users[email]]
        if len(mine) != 1:
            return None  # which order they mean is theirs to say: no task to verify
        oid = mine[0]
        withheld = {"order": oid}
    confirmed = bool(CONFIRM.search(text))
    request = _read(text, email, oid, confirmed) if email and oid else None
    first = plan(request, db_seed) if request else None  # None: no intent read, an unknown email or order
    if first is None:
        return None
    changes_mind = not withheld and HESITANT_WORDS.search(text) is not None and first["outcome"] == "confirm"
    mind = _other_wish(request.kind, orders[oid][4]) if changes_mind else None
    answer = plan(_read(mind or text, email, oid, True), db_seed)  # the last wish, confirmed when asked
    slice_ = ("changes_mind" if changes_mind else "ask_email" if "email" in withheld else
              "ask_order" if withheld else first["slice"])
    answer.update(slice=slice_, withheld=withheld, mind=mind,
                  asks_confirm=answer["kind"] in WRITE_KINDS and bool(answer["writes"]) and not confirmed)
    prompt = [{"role": "system", "content": POLICY_MT}, {"role": "user", "content": text}]
    return Task(task_id=prompt_hash(prompt), env=env, prompt=prompt, answer=json.dumps(answer, sort_keys=True),
                slice=slice_)


def task_from_messages(messages: list[dict], db_seed: int = 0) -> Task | None:
    """The task behind a recorded multi-turn conversation: its first user message, read as a generated one is."""
    first = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), None)
    return task_from_opening(first, db_seed) if first else None


def _greet(rng: random.Random, email: str) -> str:
    return rng.choice(GREETINGS).format(email=email) + " "


def _other_wish(kind: str, shipping: str) -> str:
    """What a customer who changes their mind asks instead, allowed by the policy on the same (pending) order."""
    if kind == "cancel":
        other = next(s for s in SPEEDS if s != shipping)
        return f"Actually, I changed my mind: please switch it to {other} shipping instead. I confirm."
    if kind == "modify":
        return "Actually, I changed my mind: please cancel it instead. I confirm."
    return "Actually, I'll keep it. Just tell me its status."


# --- the customer ------------------------------------------------------------------------------------------------

def customer(task: Task, messages: list[dict]) -> str:
    """The customer's reply to the agent's answer: what it asked for and the customer holds, else ###STOP###."""
    answer = task.data
    said = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    if len(said) >= MAX_USER_TURNS:
        return STOP
    asked = _text(messages[-1].get("content")).lower()
    told = " ".join(said).lower()
    parts = []
    withheld = answer.get("withheld") or {}
    if "email" in asked and "email" in withheld and withheld["email"] not in told:
        parts.append(f"It's {withheld['email']}")  # no full stop after an email
    if re.search(r"order (id|number)|which order", asked) and "order" in withheld and \
            withheld["order"].lower() not in told:
        parts.append(f"It's order {withheld['order']}.")
    if "confirm" in asked:
        if answer.get("mind") and answer["mind"] not in said:
            parts.append(answer["mind"])
        elif answer.get("asks_confirm") and not any(CONFIRM.search(text) for text in said[1:]):
            parts.append("I confirm.")
    return " ".join(parts) or STOP


# --- the oracle --------------------------------------------------------------------------------------------------

def solve(messages: list[dict], state: sqlite3.Connection | None = None) -> dict:
    """The oracle's next message: ask for what is missing, then the policy on the customer's latest wish."""
    said = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    email = next((found.group().lower().rstrip(".") for text in said if (found := EMAIL.search(text))), None)
    oid = next((found.group() for text in said if (found := ORDER.search(text))), None)
    missing = [ASK[key] for key, value in (("email", email), ("order", oid)) if value is None]
    if missing:
        return _say(f"Please tell me {' and '.join(missing)}.")
    latest = max((i for i, text in enumerate(said) if any(p.search(text) for _, p in INTENTS)), default=None)
    if latest is None:
        return _say("Please tell me what you need.")
    confirmed = any(CONFIRM.search(text) for text in said[latest:])
    request = _read(said[latest], email, oid, confirmed)
    return answer_request(request, messages, state)


# --- the rubric --------------------------------------------------------------------------------------------------

def asked(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 when the agent used a held-back detail only after the customer gave it, and wrote (when the first message
    did not confirm) only after the customer confirmed."""
    answer = task.data
    user_at = [(i, _text(m.get("content")).lower()) for i, m in enumerate(messages) if m.get("role") == "user"]
    calls = [(i, call.get("function", {})) for i, m in enumerate(messages) if m.get("role") == "assistant"
             for call in m.get("tool_calls") or []]
    for value in (answer.get("withheld") or {}).values():
        given = next((i for i, text in user_at if value.lower() in text), len(messages))
        if any(i < given and value.lower() in str(fn.get("arguments", "")).lower() for i, fn in calls):
            return 0.0
    if answer.get("asks_confirm"):
        confirmed = next((i for i, text in user_at[1:] if CONFIRM.search(text)), len(messages))
        if any(i < confirmed and fn.get("name") in dict(answer["writes"]) for i, fn in calls):
            return 0.0
    return 1.0


def resolved_conversation(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """The reward: the default mode's `resolved` on the customer's last wish, and `asked`."""
    return float(resolved(task, messages, state) == 1.0 and asked(task, messages, state) == 1.0)
