"""A banking agent's whole conversations, logged the way a public benchmark logs its runs (tau-bench style).

    python examples/agent_traces.py OUT.jsonl[.gz] [--n 780] [--seed 0]

(examples/traces/bank/nordbank-agent.jsonl.gz is its output with the defaults: 260 scenarios, 3 attempts each.)

Each line is one attempt at a scenario, in a shape of its own (collect maps it, `shape: mapped`):

    {"task_id": "bank-17",                 the scenario: every attempt at it repeats the id
     "trial": 0,                           the attempt, 0..trials-1: task_id + trial is unique
     "timestamp": "2026-11-18T09:41:00Z",
     "messages": [...],                    OpenAI chat format: system, user, assistant, tool
     "tools": [...],                       the seven tool schemas (TOOLS)
     "reward": 1.0,                        the benchmark's label: 1.0 when the writes were the right ones
     "info": {"user_goal": "You are Ana Lee, member 10017. ...",
              "expected_actions": [{"name": "transfer_funds", "arguments": {...}}, ...]}}

pipelines.yaml reads it with `fields: {id: [task_id, trial], scenario: info.user_goal, expected_actions:
info.expected_actions, score: reward}`, `outcome: {score_threshold: 0.5}` and `collect.group_by: task_id`, so
every attempt at a held-out scenario stays held out. A simulated user replays a scenario from its `user_goal`.

A conversation opens with the problem but no member number; the agent asks for it, identifies the member
(find_customer, list_accounts), does the reads and the writes of two or three requests of different kinds
(a transfer, a disputed card payment, the balances, a lost or stolen card, the payments to a merchant, an ATM that
paid no cash; at least one of them a write: transfer_funds, block_card or create_ticket), and says goodbye: 4 to
8 user turns and 5 to 10 calls, several in one turn at times, with call ids that start again at call_0 in every
turn, as many agents write them. The attempts at a scenario open with other words and may make other reads;
about one in five makes one wrong write (another amount, card, payment or withdrawal than asked) and gets
reward 0.0. Every turn is short: a small student (SmolLM2-135M) is to learn them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

SYSTEM = ("You are the support agent of NordBank. Identify the member by member number first, ask before you move "
          "money or open a ticket, and state amounts, ids and dates exactly as the tools return them.")
FIRST_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Gina", "Hugo", "Ines", "Jonas", "Kira", "Liam",
               "Maya", "Nils", "Omar", "Pia", "Rui", "Sofia", "Tomas", "Vera"]
LAST_NAMES = ["Lee", "Novak", "Berg", "Okafor", "Silva", "Haddad", "Moreau", "Jensen", "Kowalski", "Rossi", "Tanaka",
              "Nagy", "Dubois", "Costa"]
MERCHANTS = ["CoffeeCorner", "MetroRail", "BookNook", "GreenGrocer", "CinemaMax", "TechHub", "PetPalace", "FitGym",
             "PizzaPoint", "CityCab"]
ATMS = ["Central Station", "Harbour Mall", "Main Street", "the airport"]

GREETINGS = ["", "Hi!", "Hello.", "Good morning.", "Hi there.", "Hey."]
ASK_MEMBER = ["Could you give me your member number, please?",
              "I can help with that. Could you give me your member number, please?",
              "Happy to help. What is your member number?"]
GIVE_MEMBER = ["It's {member}.", "Sure, {member}.", "My member number is {member}.", "{member}", "Yes: {member}.",
               "{member}, thanks.", "Member number {member}."]
CONFIRM = ["Yes, please.", "Yes, go ahead.", "That's right, please do.", "Yes.", "Correct, do it.", "Please do."]
CLOSING = ["Thanks, that's all.", "Great, thank you. That's everything.", "Perfect, thanks. Bye!",
           "That's all I needed, thanks.", "Nothing else, thank you.", "All good, bye."]
GOODBYE = ["You're welcome. Have a nice day!", "Glad I could help. Goodbye!", "You're welcome, take care.",
           "Happy to help. Bye!"]


def _json(value: object) -> str:
    """JSON as the agent's logger writes it: compact."""
    return json.dumps(value, separators=(",", ":"))


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


@dataclass
class Customer:
    """A member as the bank's tools know them; the ids are derived from the scenario's number."""

    number: int
    name: str
    balances: dict[str, float]  # by account kind: checking, savings

    @property
    def member(self) -> str:
        return f"{10000 + self.number}"  # five digits: nothing collect's redaction takes for a phone or card

    @property
    def customer_id(self) -> str:
        return f"C-{100 + self.number}"

    @property
    def accounts(self) -> dict[str, str]:
        return {"checking": f"ACC-{1000 + 2 * self.number}", "savings": f"ACC-{1001 + 2 * self.number}"}

    @property
    def cards(self) -> dict[str, str]:
        return {"debit": f"CARD-{5000 + self.number}", "credit": f"CARD-{6000 + self.number}"}

    def profile(self) -> dict:
        """What find_customer returns."""
        return {"customer_id": self.customer_id, "name": self.name,
                "cards": [{"card_id": card, "type": kind, "status": "active"} for kind, card in self.cards.items()]}

    def account_list(self) -> list[dict]:
        """What list_accounts returns."""
        return [{"account_id": account, "type": kind, "currency": "EUR"} for kind, account in self.accounts.items()]


class Chat:
    """One attempt's messages and the bank's state as the attempt changes it."""

    def __init__(self, rng: random.Random, customer: Customer, day: str):
        self.rng, self.customer, self.day = rng, customer, day
        self.balances = dict(customer.balances)  # a wrong transfer leaves other balances than a right one
        self.balances_known = False  # the agent read both balances and needs not read them again
        self.greeting = ""
        self.messages = [{"role": "system", "content": SYSTEM}]

    def user(self, *phrasings: str) -> None:
        self.messages.append({"role": "user", "content": self.rng.choice(phrasings)})

    def call(self, *calls: tuple[str, dict, object]) -> None:
        """One assistant turn making `calls` (name, arguments, result), then their results."""
        ids = [f"call_{i}" for i in range(len(calls))]
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": _json(arguments)}}
            for i, (name, arguments, _) in zip(ids, calls, strict=True)]})
        for i, (_, _, result) in zip(ids, calls, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": i, "content": _json(result)})

    def say(self, text: str) -> None:
        """An assistant answer; the first one after the member is identified thanks them by name."""
        self.messages.append({"role": "assistant", "content": self.greeting + text})
        self.greeting = ""

    def balance(self, kind: str) -> tuple[str, dict, dict]:
        """A get_balance call on the customer's `kind` account, with its result."""
        account = self.customer.accounts[kind]
        return "get_balance", {"account_id": account}, {"account_id": account, "balance": self.balances[kind],
                                                        "currency": "EUR"}


@dataclass
class Transfer:
    customer: Customer
    source: str  # "checking" or "savings"
    target: str
    amount: float

    def goal(self) -> str:
        return f"you want to move {self.amount:.2f} EUR from your {self.source} to your {self.target} account"

    def openings(self) -> list[str]:
        a, s, t = f"{self.amount:.2f}", self.source, self.target
        return [f"I'd like to move {a} EUR from my {s} to my {t} account.",
                f"Can you transfer {a} EUR from my {s} account to my {t} account?",
                f"I need {a} EUR moved from {s} to {t}, please.",
                f"Please move {a} EUR from my {s} into my {t} account."]

    def asks(self) -> list[str]:
        a, s, t = f"{self.amount:.2f}", self.source, self.target
        return [f"Could you also move {a} EUR from my {s} to my {t} account?",
                f"One more thing: please transfer {a} EUR from {s} to {t}.",
                f"Then I'd like to move {a} EUR from my {s} to my {t} account."]

    def expected(self) -> list[dict]:
        source, target = self.customer.accounts[self.source], self.customer.accounts[self.target]
        return [{"name": "transfer_funds",
                 "arguments": {"from_account": source, "to_account": target, "amount": self.amount}}]

    def play(self, chat: Chat, first: bool, wrong: bool) -> None:
        source, target = self.customer.accounts[self.source], self.customer.accounts[self.target]
        held = ""
        if not chat.balances_known:
            read = [self.source, self.target] if chat.rng.random() < 0.4 else [self.source]
            chat.call(*[chat.balance(kind) for kind in read])
            held = "Your " + " and your ".join(
                f"{kind} account {self.customer.accounts[kind]} holds {chat.balances[kind]:.2f} EUR"
                for kind in read) + ". "
        chat.say(f"{held}Shall I move {self.amount:.2f} EUR from {source} to your {self.target} account {target}?")
        chat.user(*CONFIRM)
        moved = self.amount + chat.rng.choice([10.0, 50.0, 100.0]) if wrong else self.amount
        chat.balances[self.source] = round(chat.balances[self.source] - moved, 2)
        chat.balances[self.target] = round(chat.balances[self.target] + moved, 2)
        chat.balances_known = False
        transfer = f"TR-{7000 + self.customer.number}"
        chat.call(("transfer_funds", {"from_account": source, "to_account": target, "amount": moved},
                   {"transfer_id": transfer, "status": "completed", "date": chat.day,
                    "from_balance": chat.balances[self.source]}))
        chat.say(f"Done: {moved:.2f} EUR moved from {source} to {target} on {chat.day} (transfer {transfer}). "
                 f"Your {self.source} balance is now {chat.balances[self.source]:.2f} EUR.")


@dataclass
class Dispute:
    customer: Customer
    merchant: str
    payments: list[dict]  # the merchant's payments on checking, oldest first; the last is the disputed one

    def goal(self) -> str:
        return (f"you want to dispute a payment of {self.payments[-1]['amount']:.2f} EUR to {self.merchant} "
                "that you do not recognise")

    def openings(self) -> list[str]:
        a, m = f"{self.payments[-1]['amount']:.2f}", self.merchant
        return [f"I don't recognise a payment of {a} EUR to {m}.",
                f"There's a {a} EUR charge from {m} on my account that I never made.",
                f"I want to dispute a payment to {m} of {a} EUR.",
                f"Something's wrong: I see {a} EUR paid to {m} and it wasn't me."]

    def asks(self) -> list[str]:
        a, m = f"{self.payments[-1]['amount']:.2f}", self.merchant
        return [f"Also, I don't recognise a payment of {a} EUR to {m}.",
                f"There's also a {m} charge of {a} EUR I never made. Can you look into it?",
                f"One more thing: I want to dispute a {a} EUR payment to {m}."]

    def _summary(self, payment: dict) -> str:
        return f"Disputed payment {payment['transaction_id']} of {payment['amount']:.2f} EUR to {self.merchant}"

    def expected(self) -> list[dict]:
        return [{"name": "create_ticket",
                 "arguments": {"customer_id": self.customer.customer_id, "summary": self._summary(self.payments[-1])}}]

    def play(self, chat: Chat, first: bool, wrong: bool) -> None:
        checking, savings = self.customer.accounts["checking"], self.customer.accounts["savings"]
        searched = [checking, savings] if chat.rng.random() < 0.5 else [checking]
        chat.call(*[("search_transactions", {"account_id": a, "query": self.merchant},
                     self.payments if a == checking else []) for a in searched])
        found = " and ".join(f"{p['transaction_id']} on {p['date']} for {p['amount']:.2f} EUR" for p in self.payments)
        none = f" There are none on your savings account {savings}." if savings in searched else ""
        asked = self.payments[-1]
        chat.say(f"I found two payments to {self.merchant} on your checking account {checking}: {found}.{none} "
                 f"Shall I open a dispute for {asked['transaction_id']} ({asked['amount']:.2f} EUR)?")
        chat.user(*CONFIRM)
        disputed = self.payments[0] if wrong else asked
        ticket = f"TK-{3000 + self.customer.number}"
        chat.call(("create_ticket", {"customer_id": self.customer.customer_id, "summary": self._summary(disputed)},
                   {"ticket_id": ticket, "status": "open", "created": chat.day}))
        chat.say(f"I opened dispute ticket {ticket} for {disputed['transaction_id']} ({disputed['amount']:.2f} EUR "
                 f"to {self.merchant} on {disputed['date']}). We will contact you once it is reviewed.")


@dataclass
class Balances:
    customer: Customer

    def goal(self) -> str:
        return "you want to know the balances of your accounts"

    def openings(self) -> list[str]:
        return ["How much money do I have on my accounts?", "Could you tell me my account balances?",
                "I'd like to check my balances, please.", "What are the balances on my checking and savings?"]

    def asks(self) -> list[str]:
        return ["What are my balances now?", "How much is on my accounts now?", "Can you tell me my balances?"]

    def expected(self) -> list[dict]:
        return []

    def play(self, chat: Chat, first: bool, wrong: bool) -> None:
        checking, savings = self.customer.accounts["checking"], self.customer.accounts["savings"]
        chat.call(chat.balance("checking"), chat.balance("savings"))
        chat.balances_known = True
        chat.say(f"Your checking account {checking} holds {chat.balances['checking']:.2f} EUR and your savings "
                 f"account {savings} holds {chat.balances['savings']:.2f} EUR.")


@dataclass
class Block:
    customer: Customer
    kind: str  # "debit" or "credit"
    reason: str  # "stolen" or "lost"

    @property
    def card(self) -> str:
        return self.customer.cards[self.kind]

    def goal(self) -> str:
        return f"you want your {self.kind} card {self.card} blocked because it was {self.reason}"

    def openings(self) -> list[str]:
        return [f"My card was {self.reason}, I need it blocked right away.",
                f"I think my card was {self.reason}. Can you block it?",
                f"Please block my card, it was {self.reason}.",
                f"I need to report a {self.reason} card."]

    def asks(self) -> list[str]:
        return [f"Also, my {self.kind} card {self.card} was {self.reason}. Please block it.",
                f"One more thing: please block my {self.kind} card {self.card}, it was {self.reason}."]

    def expected(self) -> list[dict]:
        return [{"name": "block_card", "arguments": {"card_id": self.card, "reason": self.reason}}]

    def play(self, chat: Chat, first: bool, wrong: bool) -> None:
        cards = self.customer.cards
        if first:  # the opening said "my card": which one?
            chat.say(f"I see two cards on your profile: debit card {cards['debit']} and credit card "
                     f"{cards['credit']}. Which one was {self.reason}?")
            chat.user(f"The {self.kind} card, {self.card}.", f"It's the {self.kind} one, {self.card}.",
                      f"{self.card}, my {self.kind} card.")
        kind = next(k for k in cards if k != self.kind) if wrong else self.kind
        chat.call(("block_card", {"card_id": cards[kind], "reason": self.reason},
                   {"card_id": cards[kind], "status": "blocked", "reason": self.reason}))
        chat.say(f"Your {kind} card {cards[kind]} is now blocked (reason: {self.reason}). "
                 "A replacement can be ordered in the app.")



@dataclass
class Spending:
    customer: Customer
    merchant: str
    payments: list[dict]  # the member's own payments to the merchant on checking, oldest first

    def goal(self) -> str:
        return f"you want to know how much you paid to {self.merchant} this month"

    def openings(self) -> list[str]:
        m = self.merchant
        return [f"How much did I pay to {m} this month?", f"Can you list my payments to {m}?",
                f"What did I spend at {m} lately?", f"I'd like to see my {m} payments."]

    def asks(self) -> list[str]:
        m = self.merchant
        return [f"Also, how much did I pay to {m}?", f"And what did I spend at {m}?"]

    def expected(self) -> list[dict]:
        return []

    def play(self, chat: Chat, first: bool, wrong: bool) -> None:
        checking = self.customer.accounts["checking"]
        chat.call(("search_transactions", {"account_id": checking, "query": self.merchant}, self.payments))
        listed = " and ".join(f"{p['amount']:.2f} EUR on {p['date']}" for p in self.payments)
        total = sum(p["amount"] for p in self.payments)
        chat.say(f"You paid {self.merchant} {listed}: {total:.2f} EUR in all.")


@dataclass
class Atm:
    customer: Customer
    place: str
    withdrawals: list[dict]  # two at the place's ATM, oldest first: the member got the cash of the first only

    def goal(self) -> str:
        return (f"the ATM at {self.place} took {self.withdrawals[-1]['amount']:.2f} EUR from your account but gave "
                "you no cash, and you want it investigated")

    def openings(self) -> list[str]:
        a, p = f"{self.withdrawals[-1]['amount']:.2f}", self.place
        return [f"The ATM at {p} took {a} EUR but gave me no cash.", f"I withdrew {a} EUR at {p} and got nothing.",
                f"An ATM at {p} charged me {a} EUR without giving me the money.",
                f"No cash came out of the {p} ATM, but {a} EUR is gone."]

    def asks(self) -> list[str]:
        a, p = f"{self.withdrawals[-1]['amount']:.2f}", self.place
        return [f"Also, the ATM at {p} took {a} EUR and gave me no cash.",
                f"One more thing: I got no cash at {p}, but {a} EUR was taken."]

    def _summary(self, withdrawal: dict) -> str:
        return f"No cash paid out at ATM {self.place} for withdrawal {withdrawal['transaction_id']}"

    def expected(self) -> list[dict]:
        return [{"name": "create_ticket", "arguments": {"customer_id": self.customer.customer_id,
                                                        "summary": self._summary(self.withdrawals[-1])}}]

    def play(self, chat: Chat, first: bool, wrong: bool) -> None:
        checking, failed = self.customer.accounts["checking"], self.withdrawals[-1]
        chat.call(("search_transactions", {"account_id": checking, "query": f"ATM {self.place}"}, self.withdrawals))
        chat.say(f"The failed one is {failed['transaction_id']}, {failed['amount']:.2f} EUR on {failed['date']}. "
                 "Shall I open a ticket for it?")
        chat.user(*CONFIRM)
        chosen = self.withdrawals[0] if wrong else failed
        ticket = f"TK-{4000 + self.customer.number}"
        chat.call(("create_ticket", {"customer_id": self.customer.customer_id, "summary": self._summary(chosen)},
                   {"ticket_id": ticket, "status": "open", "created": chat.day}))
        chat.say(f"I opened ticket {ticket} for withdrawal {chosen['transaction_id']}. We reply within 5 days.")


Request = Transfer | Dispute | Balances | Block | Spending | Atm
# the calls each kind of request makes at least, and the kinds that write: a scenario is 2 or 3 requests of
# different kinds, at least one a write, and at least five calls in all (find_customer and list_accounts first)
MIN_CALLS = {"transfer": 2, "dispute": 2, "balances": 2, "block": 1, "spending": 1, "atm": 2}
WRITES = ("transfer", "dispute", "block", "atm")


def draw_plan(rng: random.Random) -> tuple[str, ...]:
    """The kinds of a scenario's requests, in order."""
    while True:
        kinds = tuple(rng.sample(list(MIN_CALLS), 3 if rng.random() < 0.15 else 2))
        if any(k in WRITES for k in kinds) and 2 + sum(MIN_CALLS[k] for k in kinds) >= 5:
            return kinds


def draw_request(rng: random.Random, kind: str, customer: Customer) -> Request:
    """One request of `kind` with its amounts, card or payments drawn from `rng`."""
    if kind == "transfer":
        source, target = rng.choice([("checking", "savings"), ("savings", "checking")])
        return Transfer(customer, source, target, float(rng.randint(4, 80) * 5))
    if kind == "dispute":
        merchant = rng.choice(MERCHANTS)
        days = sorted(rng.sample(range(1, 29), 2))
        # two payments to the merchant: the member made the first (TX-51xxx), not the later one (TX-50xxx)
        payments = [{"transaction_id": f"TX-{51000 - 1000 * i + customer.number}", "date": f"2026-10-{day:02d}",
                     "amount": round(rng.uniform(5, 90), 2), "merchant": merchant} for i, day in enumerate(days)]
        return Dispute(customer, merchant, payments)
    if kind == "balances":
        return Balances(customer)
    if kind == "spending":
        merchant = rng.choice(MERCHANTS)
        days = sorted(rng.sample(range(1, 29), 2))
        return Spending(customer, merchant, [
            {"transaction_id": f"TX-{52000 + 1000 * i + customer.number}", "date": f"2026-10-{day:02d}",
             "amount": round(rng.uniform(3, 60), 2), "merchant": merchant} for i, day in enumerate(days)])
    if kind == "atm":
        place = rng.choice(ATMS)
        days = sorted(rng.sample(range(1, 29), 2))
        return Atm(customer, place, [
            {"transaction_id": f"TX-{54000 + 1000 * i + customer.number}", "date": f"2026-10-{day:02d}",
             "amount": float(rng.randint(2, 20) * 10), "merchant": f"ATM {place}"} for i, day in enumerate(days)])
    return Block(customer, rng.choice(["debit", "credit"]), rng.choice(["stolen", "lost"]))


@dataclass
class Scenario:
    number: int
    customer: Customer
    requests: list[Request]

    @property
    def task_id(self) -> str:
        return f"bank-{self.number}"

    def user_goal(self) -> str:
        """Instructions to whoever plays the customer: what to say, never what the tools return."""
        wants = ", then ".join(r.goal() for r in self.requests)
        return (f"You are {self.customer.name}, member {self.customer.member}. {wants[0].upper()}{wants[1:]}. "
                "Give your member number only when asked, and confirm when the agent asks. When everything is "
                "done, say goodbye.")

    def expected_actions(self) -> list[dict]:
        return [action for r in self.requests for action in r.expected()]

    def openings(self) -> list[str]:
        """Every first user line: the first request in other words, never with the member number; a request
        that names no amount or merchant says who is asking (one opening, one task: the tasks table keeps one)."""
        who = "" if any(c.isdigit() for c in self.requests[0].openings()[0]) else f"{self.customer.name} here. "
        return [f"{g} {who}{body}".strip() for g in GREETINGS for body in self.requests[0].openings()]


def draw_scenario(rng: random.Random, number: int) -> Scenario:
    """Scenario `number`: a customer with balances and a plan's requests drawn from `rng`."""
    customer = Customer(number, f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
                        {"checking": round(rng.uniform(900, 3000), 2), "savings": round(rng.uniform(1000, 9000), 2)})
    return Scenario(number, customer, [draw_request(rng, kind, customer) for kind in draw_plan(rng)])


def conversation(rng: random.Random, scenario: Scenario, opening: str, day: str, wrong_at: int | None) -> list[dict]:
    """One attempt at `scenario`; the request at index `wrong_at` (if any) makes the wrong write."""
    customer = scenario.customer
    chat = Chat(rng, customer, day)
    chat.user(opening)
    chat.say(rng.choice(ASK_MEMBER))
    chat.user(*[line.format(member=customer.member) for line in GIVE_MEMBER])
    chat.call(("find_customer", {"member_number": customer.member}, customer.profile()))
    chat.call(("list_accounts", {"customer_id": customer.customer_id}, customer.account_list()))
    chat.greeting = f"Thanks, {customer.name.split()[0]}. "
    for i, req in enumerate(scenario.requests):
        if i:
            chat.user(*req.asks())
        req.play(chat, first=i == 0, wrong=i == wrong_at)
    chat.user(*CLOSING)
    chat.say(rng.choice(GOODBYE))
    return chat.messages


def records(n: int, seed: int = 0, trials: int = 3, failed_share: float = 0.2) -> list[dict]:
    """`n` attempts, `trials` per scenario; about `failed_share` of them make one wrong write (reward 0.0)."""
    rng = random.Random(seed)
    out = []
    for number in range(math.ceil(n / trials)):
        case = draw_scenario(rng, number)
        openings = case.openings()
        if trials > len(openings):
            raise ValueError(f"trials={trials}: a scenario has only {len(openings)} different openings")
        day = f"2026-11-{1 + number % 28:02d}"
        writing = [i for i, r in enumerate(case.requests) if r.expected()]
        for trial, opening in enumerate(rng.sample(openings, trials)):
            wrong_at = rng.choice(writing) if rng.random() < failed_share else None
            out.append({"task_id": case.task_id, "trial": trial,
                        "timestamp": f"{day}T{9 + trial % 12:02d}:{rng.randint(0, 59):02d}:00Z",
                        "messages": conversation(rng, case, opening, day, wrong_at), "tools": TOOLS,
                        "reward": 0.0 if wrong_at is not None else 1.0,
                        "info": {"user_goal": case.user_goal(), "expected_actions": case.expected_actions()}})
    return out[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=780)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(_json(r) + "\n" for r in records(args.n, args.seed)).encode()
    # gzipped when the name says so: collect reads .jsonl.gz as it reads .jsonl
    args.out.write_bytes(gzip.compress(text, mtime=0) if args.out.suffix == ".gz" else text)
    print(f"{args.out}: {args.n} conversations")


if __name__ == "__main__":
    main()
