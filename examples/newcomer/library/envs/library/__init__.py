"""A library's lending desk: a patron asks to borrow or renew a book; the agent needs their card number first.

Written from the README's "Your own agent" section alone (a newcomer's environment, not a built-in). Four typed
tools over a per-episode SQLite catalogue, tasks in tasks.jsonl next to this file (written by make_tasks.py), a
simple simulated patron who gives the card number only when asked, a state rubric (exactly the right loan, hold
or renewal, for that card) and a scripted solver.

pipelines.yaml: environment: {factory: "envs.library:make_env"}
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

from flywheel.envs.sdk import Env, Reward, Task, ToolError, tasks_from_file

TITLES = ("Pride and Prejudice", "Moby-Dick", "Dracula", "Frankenstein", "Jane Eyre", "Middlemarch", "Emma",
          "Persuasion", "Great Expectations", "Bleak House", "Little Women", "The Odyssey", "Walden", "Ulysses",
          "Dubliners", "The Time Machine", "The War of the Worlds", "Heart of Darkness", "Wuthering Heights",
          "The Scarlet Letter", "Treasure Island", "Kidnapped", "The Jungle Book", "Anna Karenina", "War and Peace",
          "Crime and Punishment", "The Idiot", "Madame Bovary", "Les Miserables", "The Count of Monte Cristo",
          "Don Quixote", "Candide", "Faust", "The Trial", "Siddhartha", "The Iliad", "Beowulf", "Hamlet", "Macbeth",
          "Othello")
LOAN_DAYS = 21
TODAY = 100  # day numbers: a loan is due on day `due`


def books() -> list[tuple[str, str, int]]:
    """(id, title, copies on the shelf): every third title has none left."""
    return [(f"BK-{100 + i}", title, 0 if i % 3 == 2 else 1 + i % 2) for i, title in enumerate(TITLES)]


def loans() -> list[tuple[str, str, int]]:
    """The loans out before the episode (book id, card, due day)."""
    return [(f"BK-{100 + i}", f"C-{2000 + 7 * i}", TODAY + 1 + i % 5) for i in range(len(TITLES))]


def fresh_library(task: Task) -> sqlite3.Connection:
    """The episode's own catalogue, loans and holds."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE books (id TEXT PRIMARY KEY, title TEXT, copies INT)")
    db.execute("CREATE TABLE loans (book TEXT, card TEXT, due INT)")
    db.execute("CREATE TABLE holds (book TEXT, card TEXT)")
    db.executemany("INSERT INTO books VALUES (?, ?, ?)", books())
    db.executemany("INSERT INTO loans VALUES (?, ?, ?)", loans())
    return db


def _card(card: str) -> str:
    if not re.fullmatch(r"C-\d{4}", card):
        raise ToolError(f"'{card}' is not a card number (they look like C-2014)")
    return card


def search_catalogue(title: str, state: sqlite3.Connection) -> str:
    """Search the catalogue by title; each match with its id and how many copies are on the shelf.

    Args:
        title: the title or part of it, e.g. "Jane Eyre"
    """
    rows = state.execute("SELECT id, title, copies FROM books WHERE instr(lower(title), lower(?)) > 0",
                         (title.strip(),)).fetchall()
    return json.dumps([{"book": r[0], "title": r[1], "on_shelf": r[2]} for r in rows])


def check_out(book: str, card: str, state: sqlite3.Connection) -> str:
    """Lend a copy on the shelf to a patron for 21 days.

    Args:
        book: the book's id, e.g. "BK-104"
        card: the patron's library card number, e.g. "C-2014"
    """
    row = state.execute("SELECT copies FROM books WHERE id = ?", (book,)).fetchone()
    if row is None:
        raise ToolError(f"no book '{book}'")
    if row[0] < 1:
        raise ToolError(f"no copy of {book} is on the shelf: place a hold instead")
    state.execute("UPDATE books SET copies = copies - 1 WHERE id = ?", (book,))
    state.execute("INSERT INTO loans VALUES (?, ?, ?)", (book, _card(card), TODAY + LOAN_DAYS))
    return json.dumps({"book": book, "card": card, "due_in_days": LOAN_DAYS})


def place_hold(book: str, card: str, state: sqlite3.Connection) -> str:
    """Put a patron on the waiting list for a book with no copy on the shelf.

    Args:
        book: the book's id
        card: the patron's library card number
    """
    row = state.execute("SELECT copies FROM books WHERE id = ?", (book,)).fetchone()
    if row is None:
        raise ToolError(f"no book '{book}'")
    if row[0] > 0:
        raise ToolError(f"{book} has a copy on the shelf: check it out instead")
    state.execute("INSERT INTO holds VALUES (?, ?)", (book, _card(card)))
    waiting = state.execute("SELECT COUNT(*) FROM holds WHERE book = ?", (book,)).fetchone()[0]
    return json.dumps({"book": book, "card": card, "position": waiting})


def renew_loan(book: str, card: str, state: sqlite3.Connection) -> str:
    """Renew a patron's loan of a book for another 21 days from its due day.

    Args:
        book: the book's id
        card: the patron's library card number
    """
    changed = state.execute("UPDATE loans SET due = due + ? WHERE book = ? AND card = ?",
                            (LOAN_DAYS, book, _card(card))).rowcount
    if not changed:
        raise ToolError(f"card {card} has no loan of {book}")
    due = state.execute("SELECT due FROM loans WHERE book = ? AND card = ?", (book, card)).fetchone()[0]
    return json.dumps({"book": book, "card": card, "due_in_days": due - TODAY})


# --- the patron ---------------------------------------------------------------------------------------------

def patron(task: Task, messages: list[dict]) -> str | None:
    """Gives the card number when the agent asks for it; otherwise done (None ends the conversation)."""
    said = (messages[-1].get("content") or "").lower()
    given = any(m["role"] == "user" and task.data["card"] in m["content"] for m in messages)
    if "card" in said and not given:
        return f"Sure, it's {task.data['card']}."
    return None


# --- rubric -------------------------------------------------------------------------------------------------

def desk_right(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 when the library changed exactly as asked: the one loan, hold or renewal, on the patron's card."""
    want, card = task.data, task.data["card"]
    new_loans = set(state.execute("SELECT book, card, due FROM loans")) - set(loans())
    holds = set(state.execute("SELECT book, card FROM holds"))
    gone = set(loans()) - set(state.execute("SELECT book, card, due FROM loans"))
    if want["kind"] == "borrow":
        return float(new_loans == {(want["book"], card, TODAY + LOAN_DAYS)} and not holds and not gone)
    if want["kind"] == "hold":
        return float(holds == {(want["book"], card)} and not new_loans and not gone)
    old = next(row for row in loans() if row[:2] == (want["book"], card))
    return float(new_loans == {(want["book"], card, old[2] + LOAN_DAYS)} and gone == {old} and not holds)


# --- scripted solver ----------------------------------------------------------------------------------------

def solve(messages: list[dict], state: sqlite3.Connection) -> dict:
    """Ask for the card, find the book, then check out, hold or renew it, and say so."""
    asks = [m["content"] for m in messages if m["role"] == "user"]
    card = next((re.search(r"C-\d{4}", a).group(0) for a in asks if re.search(r"C-\d{4}", a)), None)
    if card is None:
        return _say("Happy to help. What is your library card number?")
    results = [json.loads(m["content"]) for m in messages if m["role"] == "tool" and m["content"][:1] in "[{"]
    title = re.search(r"\"([^\"]+)\"", asks[0]).group(1)
    if not results:
        return _call("search_catalogue", {"title": title})
    last = results[-1]
    if isinstance(last, list):
        book = next(b for b in last if b["title"] == title)
        if "renew" in asks[0].lower():
            return _call("renew_loan", {"book": book["book"], "card": card})
        name = "check_out" if book["on_shelf"] > 0 else "place_hold"
        return _call(name, {"book": book["book"], "card": card})
    if "position" in last:
        return _say(f"No copy of \"{title}\" is on the shelf; you are number {last['position']} on its hold list.")
    return _say(f"Done: \"{title}\" is yours for {last['due_in_days']} more days.")


def _call(name: str, arguments: dict) -> dict:
    """An assistant message that calls one tool."""
    call = {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _say(text: str) -> dict:
    """An assistant message that answers the patron."""
    return {"role": "assistant", "content": text}


def make_env() -> Env:
    """The lending desk."""
    return Env(name="library", tools=[search_catalogue, check_out, place_hold, renew_loan],
               tasks=tasks_from_file(Path(__file__).parent / "tasks.jsonl"),
               rewards=[Reward(desk_right, weight=1.0)], passed=1.0, setup=fresh_library,
               teardown=sqlite3.Connection.close, solver=solve, user=patron)
