"""A multi-turn banking agent's conversations, as an agent with no flywheel environment would log them.

    python examples/agent_traces.py OUT.jsonl [--n 60] [--seed 0]

Seven tools (find_customer, list_accounts, get_balance, search_transactions, transfer_funds, block_card,
create_ticket), 3 to 15 calls per conversation, several calls in one turn, and call ids that start again at
call_0 in every turn, as many agents write them. Each record is OpenAI chat format with its tool schemas and an
`outcome` (accepted, or rejected where the agent moved the wrong amount). This is what `environment: {name:
replay}` turns into tasks (README: "Train on your traces without writing an environment"); the tests and
benchmarks/replay.py use it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You are the support agent of NordBank. Use the tools; state amounts, ids and dates exactly."
NAMES = ["ana", "ben", "chloe", "dev", "emma", "farid", "gina", "hugo", "ines", "jonas", "kira", "liam"]
MERCHANTS = ["CoffeeCorner", "MetroRail", "BookNook", "GreenGrocer", "CinemaMax", "TechHub"]


def _tool(name: str, description: str, **params: str) -> dict:
    properties = {k: {"type": "number" if v == "number" else "string"} for k, v in params.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": list(params)}}}


TOOLS = [
    _tool("find_customer", "Find a customer by member number.", member_number="string"),
    _tool("list_accounts", "List a customer's accounts.", customer_id="string"),
    _tool("get_balance", "The balance of an account.", account_id="string"),
    _tool("search_transactions", "Search an account's transactions by merchant.", account_id="string",
          query="string"),
    _tool("transfer_funds", "Move money between two of the customer's accounts.", from_account="string",
          to_account="string", amount="number"),
    _tool("block_card", "Block a card.", card_id="string", reason="string"),
    _tool("create_ticket", "Open a support ticket.", customer_id="string", summary="string"),
]


class Agent:
    """The agent's side of one conversation: messages, with call ids that restart in every turn."""

    def __init__(self, rng: random.Random, user: str):
        self.rng = rng
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def turn(self, *calls: tuple[str, dict, dict]) -> None:
        """One assistant turn making `calls` (name, arguments, result), then their results."""
        ids = [f"call_{i}" for i in range(len(calls))]
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments, _) in zip(ids, calls, strict=True)]})
        for i, (_, _, result) in zip(ids, calls, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": i, "content": json.dumps(result)})

    def say(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def conversation(rng: random.Random, number: int, wrong: bool = False) -> list[dict]:
    """One conversation; `wrong`: the transfer moves another amount than asked (a rejected trace)."""
    name = NAMES[number % len(NAMES)]
    member = f"{10000 + number}"  # not an email: collect would redact it, and every prompt would read alike
    customer = f"C-{100 + number}"
    checking, savings = f"ACC-{1000 + 2 * number}", f"ACC-{1001 + 2 * number}"
    balances = {checking: round(rng.uniform(200, 3000), 2), savings: round(rng.uniform(100, 9000), 2)}
    accounts = [{"account_id": checking, "type": "checking"}, {"account_id": savings, "type": "savings"}]
    kind = ["transfer", "dispute", "balance"][number % 3]
    find = ("find_customer", {"member_number": member}, {"customer_id": customer, "name": name.title()})
    listing = ("list_accounts", {"customer_id": customer}, accounts)
    if kind == "transfer":
        amount = float(rng.randint(2, 40) * 5)
        agent = Agent(rng, f"Hi, I'm {name.title()}, member {member}. Please move {amount:.2f} EUR from my "
                           "checking to my savings account.")
        agent.turn(find)
        agent.turn(listing)
        moved = amount + 10 if wrong else amount
        after = round(balances[checking] - moved, 2)
        transfer = f"TR-{7000 + number}"
        agent.turn(("transfer_funds", {"from_account": checking, "to_account": savings, "amount": moved},
                    {"transfer_id": transfer, "status": "done", "new_balance": after}))
        agent.say(f"Done: {moved:.2f} EUR moved from {checking} to {savings} (transfer {transfer}). Your checking "
                  f"balance is now {after:,.2f} EUR.")
    elif kind == "dispute":
        merchant = rng.choice(MERCHANTS)
        agent = Agent(rng, f"Hello, member {member} here. I don't recognise a payment to {merchant}.")
        agent.turn(find)
        agent.turn(listing)
        tx, amount, day = f"TX-{50000 + number}", round(rng.uniform(5, 90), 2), f"2026-11-{1 + number % 28:02d}"
        agent.turn(("search_transactions", {"account_id": checking, "query": merchant},
                    [{"id": tx, "date": day, "amount": amount, "merchant": merchant}]),
                   ("search_transactions", {"account_id": savings, "query": merchant}, []))
        ticket = f"TK-{3000 + number}"
        agent.turn(("create_ticket", {"customer_id": customer, "summary": f"Disputed payment {tx} to {merchant}"},
                    {"ticket_id": ticket}))
        agent.say(f"I found {tx} on {day}: {amount:.2f} EUR to {merchant} from {checking}. I opened dispute "
                  f"ticket {ticket}.")
    else:
        agent = Agent(rng, f"Hi, this is {name.title()} (member {member}). What are my balances?")
        agent.turn(find)
        agent.turn(listing)
        agent.turn(*[("get_balance", {"account_id": a}, {"account_id": a, "balance": balances[a], "currency": "EUR"})
                     for a in (checking, savings)])
        agent.say(f"Checking {checking}: {balances[checking]:,.2f} EUR. Savings {savings}: "
                  f"{balances[savings]:,.2f} EUR.")
    if number % 2 == 0:  # a second request in the same conversation
        card = f"CARD-{5000 + number}"
        agent.messages.append({"role": "user", "content": f"Also, my card {card} was stolen. Please block it."})
        agent.turn(("block_card", {"card_id": card, "reason": "stolen"},
                    {"card_id": card, "status": "blocked", "ticket": f"T-{9000 + number}"}))
        agent.say(f"Card {card} is blocked (ticket T-{9000 + number}).")
    return agent.messages


def records(n: int, seed: int = 0, rejected_every: int = 7) -> list[dict]:
    """`n` records: every `rejected_every`-th transfer moved the wrong amount and is labelled rejected."""
    rng = random.Random(seed)
    out = []
    for number in range(n):
        wrong = rejected_every > 0 and number % 3 == 0 and (number // 3) % rejected_every == rejected_every - 1
        out.append({"id": f"conv-{number}", "timestamp": f"2026-11-{1 + number % 28:02d}T10:{number % 60:02d}:00Z",
                    "messages": conversation(rng, number, wrong), "tools": TOOLS,
                    "outcome": "rejected" if wrong else "accepted"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records(args.n, args.seed)))
    print(f"{args.out}: {args.n} conversations")


if __name__ == "__main__":
    main()
