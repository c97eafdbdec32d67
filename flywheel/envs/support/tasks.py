"""The desk's tasks: a customer's request, what the policy makes of it, and the facts a right answer states.

A task is built from the first user message alone (`task_from_text`): generated tasks are written as text and
read back by the same function that reads a recorded conversation, so the two cannot drift apart. What the
policy says to do follows from the request and the seed's database:

    outcome    when                                              writes                  slice
    lookup     a question about an order of the user's           none                    lookup
    do         a write the policy allows, confirmed              the write               cancel/modify/refund/transfer
    confirm    a write the policy allows, not confirmed          none (ask to confirm)   confirm
    refuse     the order is not the user's, or its status        none (say why)          refuse
               forbids the write
    hard       2-4 of the above in one message, one per order    each part's             hard
               (the "hard" slice: 5-12 tool calls; `generate`'s hard_fraction of the stream)

A hard message is read sentence by sentence: each sentence that names an order is that order's request, and
"I confirm" anywhere confirms every write in it. A message that names one order is read whole, as it always was.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

import flywheel.envs.support.db as database
from flywheel.contract import Task, prompt_hash

# Terse on purpose: every training conversation of the tiny demo student carries it (tokens cost CPU time).
POLICY = ("ShopCo support policy: find_user by email, then list_orders; an order not in the list is not one of "
          "their orders. get_order before acting. Cancel or change shipping: pending orders only. Refund: "
          "delivered orders only. Write only if the user wrote 'I confirm', else give status and total and ask "
          "them to confirm. Damaged or lost: transfer_to_human. Refuse the rest, saying why.")

EMAIL = re.compile(r"[a-z0-9_.+-]+@[a-z0-9-]+\.[a-z.]+", re.IGNORECASE)
ORDER = re.compile(r"\bW\d{4}\b")
CONFIRM = re.compile(r"\bi confirm\b", re.IGNORECASE)
SENTENCE = re.compile(r"(?<=[.!?])\s+")  # "ana.lee@mail.com" and "45.20" stay whole: no space after their dots
# (kind, pattern) in the order they are tried: "refund for the damaged..." is a transfer, not a refund
INTENTS = [("transfer", re.compile(r"damaged|broken|never arrived|lost", re.IGNORECASE)),
           ("refund", re.compile(r"refund|money back", re.IGNORECASE)),
           ("cancel", re.compile(r"cancel", re.IGNORECASE)),
           ("modify", re.compile(r"express|standard shipping", re.IGNORECASE)),
           ("lookup", re.compile(r"status|where is|check", re.IGNORECASE))]
ALLOWED = {"cancel": {"pending"}, "modify": {"pending"}, "refund": {"delivered"},
           "transfer": {"pending", "shipped", "delivered", "cancelled"}}
VERB = {"cancel": "cancel", "modify": "change the shipping of", "refund": "refund"}

GREETINGS = ["Hi, I'm {email}.", "Hello, this is {email}.", "My email is {email}.", "Hi! {email} here."]
REQUESTS = {
    "lookup": ["What is the status of order {oid}?", "Where is my order {oid}?", "Can you check order {oid}?"],
    "cancel": ["Please cancel order {oid}.", "I want to cancel order {oid}.", "Cancel my order {oid}, please."],
    "modify": ["Please switch order {oid} to {speed} shipping.", "Can order {oid} ship {speed} instead?",
               "I'd like {speed} shipping for order {oid}."],
    "refund": ["I want a refund for order {oid}.", "Please refund order {oid}.", "Can I get my money back for {oid}?"],
    "transfer": ["Order {oid} arrived damaged.", "My order {oid} never arrived.", "Order {oid} was lost in the mail."],
}
# slice -> share of generated tasks
SLICES = {"lookup": 0.14, "cancel": 0.14, "modify": 0.12, "refund": 0.14, "transfer": 0.1, "confirm": 0.14,
          "refuse": 0.22}
# hard tasks: the oracle's tool calls (find_user, list_orders, a get_order per own order asked about, the
# writes; a user has 1-3 orders, so 2-4 requests make 8 calls at most today), and how their requests are drawn
HARD_CALLS = (5, 12)
HARD_KINDS = {"lookup": 2, "cancel": 3, "modify": 2, "refund": 3, "transfer": 1}
HARD_FITTING = 0.5  # the chance an own order is asked what its status allows (else a kind drawn from HARD_KINDS)
HARD_NOT_OWNED = 0.4  # the chance a message also asks about another user's order
HARD_CONFIRMED = 0.85
CONNECTORS = ["", "Also, ", "And "]


@dataclass(frozen=True)
class Request:
    """What the first user message asks: who, which order, what, and whether they confirmed."""

    email: str
    order_id: str
    kind: str  # lookup | cancel | modify | refund | transfer
    confirmed: bool
    speed: str | None = None  # modify: the speed asked for
    problem: str | None = None  # transfer: damaged | lost


def parse_request(text: str) -> Request | None:
    """The request in a customer's message, or None when it lacks an email, an order id or a known intent."""
    email, order = EMAIL.search(text), ORDER.search(text)
    if not (email and order):
        return None
    return _read(text, email.group().lower(), order.group(), bool(CONFIRM.search(text)))


def parse_requests(text: str) -> list[Request]:
    """Every request in a customer's message: one per order named (a hard task), else what parse_request reads.

    Each order is read from the sentences that name it. When that cannot be done (a sentence naming an order with
    no known intent, one order asked two things) the message is read whole, as a single request."""
    single = parse_request(text)
    if single is None or len(set(ORDER.findall(text))) < 2:
        return [single] if single else []
    confirmed, by_order = single.confirmed, {}
    for sentence in SENTENCE.split(text):
        for order_id in ORDER.findall(sentence):
            request = _read(sentence, single.email, order_id, confirmed)
            if request is None or by_order.setdefault(order_id, request) != request:
                return [single]
    return list(by_order.values())


def _read(text: str, email: str, order_id: str, confirmed: bool) -> Request | None:
    """The request `text` makes about one order, or None when it states no known intent."""
    kind = next((k for k, pattern in INTENTS if pattern.search(text)), None)
    if kind is None:
        return None
    speed = problem = None
    if kind == "modify":
        speed = "express" if re.search("express", text, re.IGNORECASE) else "standard"
    if kind == "transfer":
        problem = "damaged" if re.search("damaged|broken", text, re.IGNORECASE) else "lost"
    return Request(email, order_id, kind, confirmed, speed, problem)


def plan(request: Request, db_seed: int) -> dict | None:
    """What the policy makes of a request in the seed's database: the task's answer (verifier data), or None.

    Keys: outcome, slice, user_id, order_id, writes (the calls the agent must make, as [name, arguments]),
    facts (each a list of alternatives, one of which the final answer must contain), reply (the oracle's text),
    db_seed (the database the task is posed against).
    """
    users, orders = _directory(db_seed)
    user_id, order = users.get(request.email), orders.get(request.order_id)
    if user_id is None or order is None:
        return None  # the desk's database does not know them: nothing to verify against
    return {"email": request.email, "user_id": user_id, "order_id": order[0], "kind": request.kind,
            "db_seed": db_seed, **decide(request, order[1] == user_id, _shown(order, user_id))}


def plan_hard(requests: list[Request], db_seed: int) -> dict | None:
    """What the policy makes of several requests in one message (slice "hard"), or None.

    Keys: outcome and slice "hard", parts (each request's order_id, kind and `decide` keys, in message order),
    writes and facts (every part's, in that order: the rubric reads them as it reads a single request's),
    reply (the parts' replies joined), email, user_id, db_seed. The rubric checks each part's facts in the
    sentences of the answer about its order."""
    users, orders = _directory(db_seed)
    email = requests[0].email
    user_id = users.get(email)
    if user_id is None or any(r.order_id not in orders for r in requests):
        return None
    parts = []
    for request in requests:
        order = orders[request.order_id]
        parts.append({"order_id": order[0], "kind": request.kind,
                      **decide(request, order[1] == user_id, _shown(order, user_id))})
    return {"email": email, "user_id": user_id, "db_seed": db_seed, "outcome": "hard", "slice": "hard",
            "parts": parts, "writes": [w for p in parts for w in p["writes"]],
            "facts": [f for p in parts for f in p["facts"]], "reply": " ".join(p["reply"] for p in parts)}


def tool_calls_needed(answer: dict) -> int:
    """The tool calls the policy takes for a task: find_user, list_orders, get_order per own order, the writes."""
    parts = answer.get("parts", [answer])
    return 2 + sum(p.get("reason") != "not_owner" for p in parts) + len(answer["writes"])


def _shown(order: tuple, user_id: str) -> dict | None:
    """The order as get_order shows it, or None when it is not the user's (the policy never looks it up)."""
    _, owner, status, cents, shipping, payment = order
    if owner != user_id:
        return None
    return {"status": status, "total": database.money(cents), "shipping": shipping, "payment": payment}


@functools.lru_cache(maxsize=8)
def _directory(db_seed: int) -> tuple[dict[str, str], dict[str, tuple]]:
    """The seed's users by email and orders by id, read once: tasks are posed against the untouched database."""
    conn = database.fresh(db_seed)
    try:
        users = dict(conn.execute("SELECT email, user_id FROM users"))
        orders = {row[0]: row for row in conn.execute(
            "SELECT order_id, user_id, status, total_cents, shipping, payment FROM orders")}
    finally:
        conn.close()
    return users, orders


def decide(request: Request, owned: bool, order: dict | None) -> dict:
    """The policy applied to a request and the order as get_order shows it (None: not the user's order).

    The task's answer and the oracle's next move both come from here: the rubric and the teacher read one policy.
    """
    oid, kind = request.order_id, request.kind
    if not owned or order is None:
        return {"outcome": "refuse", "slice": "refuse", "reason": "not_owner", "writes": [],
                "facts": [[oid], ["not one of your orders"]], "reply": f"Order {oid} is not one of your orders."}
    status, total, shipping, payment = order["status"], order["total"], order["shipping"], order["payment"]
    if kind == "lookup":
        return {"outcome": "lookup", "slice": "lookup", "writes": [], "facts": [[status], [total]],
                "reply": f"Order {oid} is {status}, total {total}."}
    if kind == "modify" and request.speed == shipping:
        return {"outcome": "refuse", "slice": "refuse", "reason": "same_speed", "writes": [],
                "facts": [[oid], [shipping]], "reply": f"Order {oid} already ships {shipping}."}
    if status not in ALLOWED[kind]:
        return {"outcome": "refuse", "slice": "refuse", "reason": "status", "writes": [],
                "facts": [[oid], [status]], "reply": f"I cannot {VERB[kind]} order {oid}: it is {status}."}
    if kind == "transfer":
        ticket = f"T{oid[1:]}"
        return {"outcome": "do", "slice": "transfer",
                "writes": [["transfer_to_human", {"order_id": oid, "reason": request.problem}]],
                "facts": [[ticket]], "reply": f"Order {oid} is with a human agent now, ticket {ticket}."}
    if not request.confirmed:
        action = f"switch it to {request.speed} shipping" if kind == "modify" else f"{kind} it"
        return {"outcome": "confirm", "slice": "confirm", "writes": [],
                "facts": [[oid], [status], [total], ["confirm"]],
                "reply": f"Order {oid} is {status}, total {total}. Please confirm that I should {action}."}
    if kind == "cancel":
        return {"outcome": "do", "slice": "cancel", "writes": [["cancel_order", {"order_id": oid}]],
                "facts": [[oid], ["cancelled"], [total]],
                "reply": f"Order {oid} is cancelled; {total} goes back to {payment}."}
    if kind == "modify":
        return {"outcome": "do", "slice": "modify",
                "writes": [["change_shipping", {"order_id": oid, "speed": request.speed}]],
                "facts": [[oid], [request.speed]], "reply": f"Order {oid} now ships {request.speed}."}
    return {"outcome": "do", "slice": "refund", "writes": [["refund_order", {"order_id": oid}]],
            "facts": [[oid], [total], [payment]], "reply": f"Refunded {total} to {payment} for order {oid}."}


def task_from_text(text: str, db_seed: int, env: str = "support") -> Task | None:
    """The task a customer's first message poses, with the policy as the system prompt; None if unverifiable."""
    requests = parse_requests(text)
    if len(requests) > 1:
        answer = plan_hard(requests, db_seed)
    else:
        answer = plan(requests[0], db_seed) if requests else None
    if answer is None:
        return None
    prompt = [{"role": "system", "content": POLICY}, {"role": "user", "content": text}]
    return Task(task_id=prompt_hash(prompt), env=env, prompt=prompt, answer=json.dumps(answer, sort_keys=True),
                slice=answer["slice"])


def generate(seed: int, db_seed: int, env: str = "support", hard_fraction: float = 0.0) -> Iterator[Task]:
    """An endless seeded stream of requests, slices in the shares of SLICES (drawn, then kept when they fit).

    hard_fraction: the share that are hard tasks, decided and drawn by a generator of their own, so the other
    tasks are the same stream as with none (0.0: exactly today's tasks)."""
    rng, hard = random.Random(seed), random.Random(f"support-hard:{seed}")
    conn = database.fresh(db_seed)
    users = conn.execute("SELECT user_id, email FROM users ORDER BY user_id").fetchall()
    orders: dict[str, list[str]] = {}
    for oid, user_id in conn.execute("SELECT order_id, user_id FROM orders ORDER BY order_id"):
        orders.setdefault(user_id, []).append(oid)
    conn.close()
    all_orders = sorted(o for owned in orders.values() for o in owned)
    slices, weights = list(SLICES), list(SLICES.values())
    while True:
        if hard_fraction and hard.random() < hard_fraction:
            yield _hard_task(hard, users, orders, all_orders, db_seed, env)
            continue
        wanted = rng.choices(slices, weights)[0]
        for _ in range(200):  # a draw fits its slice often enough (about one in five at worst)
            user_id, email = rng.choice(users)
            oid = rng.choice(all_orders) if rng.random() < 0.12 else rng.choice(orders[user_id])
            kind = {"confirm": rng.choice(["cancel", "modify", "refund"]), "lookup": "lookup"}.get(
                wanted, wanted if wanted in REQUESTS else rng.choice(["cancel", "modify", "refund", "lookup"]))
            # refusals come confirmed or not: a confirmation never makes a forbidden write allowed
            confirmed = (kind in ("cancel", "modify", "refund") and wanted != "confirm"
                         and (wanted != "refuse" or rng.random() < 0.6))
            text = rng.choice(GREETINGS).format(email=email) + " " + rng.choice(REQUESTS[kind]).format(
                oid=oid, speed=rng.choice(database.SPEEDS)) + (" I confirm." if confirmed else "")
            task = task_from_text(text, db_seed, env)
            if task is not None and task.slice == wanted:
                yield task
                break


def _hard_task(rng: random.Random, users: list[tuple], orders: dict[str, list[str]], all_orders: list[str],
               db_seed: int, env: str) -> Task:
    """One hard task: a user's message with a request on 2-3 of their orders and, at times, one on another user's,
    kept when the policy needs HARD_CALLS tool calls for it."""
    statuses = {oid: row[2] for oid, row in _directory(db_seed)[1].items()}
    kinds, kind_weights = list(HARD_KINDS), list(HARD_KINDS.values())
    several = [(user_id, email) for user_id, email in users if len(orders[user_id]) > 1]
    while True:
        user_id, email = rng.choice(several)
        chosen = rng.sample(orders[user_id], rng.randint(2, len(orders[user_id])))
        asked = []
        for oid in chosen:
            writable = [k for k in ("cancel", "modify", "refund") if statuses[oid] in ALLOWED[k]]
            fitting = writable or ["lookup", "transfer"]
            asked.append((oid, rng.choice(fitting) if rng.random() < HARD_FITTING
                          else rng.choices(kinds, kind_weights)[0]))
        if rng.random() < HARD_NOT_OWNED:
            other = rng.choice([o for o in all_orders if o not in orders[user_id]])
            asked.insert(rng.randint(0, len(asked)), (other, rng.choices(kinds, kind_weights)[0]))
        sentences = []
        for i, (oid, kind) in enumerate(asked):
            request = rng.choice(REQUESTS[kind]).format(oid=oid, speed=rng.choice(database.SPEEDS))
            connector = rng.choice(CONNECTORS) if i else ""
            if connector and not request.startswith("I"):
                request = request[0].lower() + request[1:]
            sentences.append(connector + request)
        confirmed = rng.random() < HARD_CONFIRMED
        text = " ".join([rng.choice(GREETINGS).format(email=email), *sentences, *(["I confirm."] if confirmed else [])])
        task = task_from_text(text, db_seed, env)
        if task is not None and task.slice == "hard" and \
                HARD_CALLS[0] <= tool_calls_needed(json.loads(task.answer)) <= HARD_CALLS[1]:
            return task
