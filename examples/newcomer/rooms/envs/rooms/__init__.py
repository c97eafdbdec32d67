"""Meeting rooms: book, move and cancel meetings in an office's room calendar for one week.

Written from the README's "Your own agent" section alone (a newcomer's environment, not a built-in). Four typed
tools over a per-episode SQLite calendar, tasks from a seeded generator (no task file), a state rubric (the
calendar ends exactly as the request asks) and a scripted solver.

pipelines.yaml: environment: {factory: "envs.rooms:make_env"}
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Iterator
from typing import Literal

from flywheel.envs.sdk import Env, Reward, Task, ToolError

Day = Literal["mon", "tue", "wed", "thu", "fri"]
DAYS = ("mon", "tue", "wed", "thu", "fri")
DAY_NAMES = {"mon": "Monday", "tue": "Tuesday", "wed": "Wednesday", "thu": "Thursday", "fri": "Friday"}
ROOMS = {"Aspen": 4, "Birch": 6, "Cedar": 8, "Elm": 12, "Oak": 20}  # name -> seats
OPEN, CLOSE = 8, 18  # bookable hours
TITLES = ("Design review", "Standup", "Budget sync", "Interview", "Retro", "Planning", "1:1", "Demo prep",
          "Hiring panel", "Roadmap", "Offsite prep", "Vendor call")


def existing_bookings() -> list[tuple[str, str, str, int, int, str]]:
    """The week as it stands before any request (id, room, day, start, end, title): the same every episode."""
    rng = random.Random(7)
    rows, n = [], 0
    for day in DAYS:
        for room in ROOMS:
            hour = OPEN
            while True:
                hour += rng.choice((0, 1, 2, 3))
                length = rng.choice((1, 1, 2))
                if hour + length > CLOSE:
                    break
                rows.append((f"B-{100 + n}", room, day, hour, hour + length, rng.choice(TITLES)))
                n += 1
                hour += length
    return rows


def fresh_calendar(task: Task) -> sqlite3.Connection:
    """The episode's own calendar."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE bookings (id TEXT PRIMARY KEY, room TEXT, day TEXT, start INT, end INT, title TEXT)")
    db.executemany("INSERT INTO bookings VALUES (?, ?, ?, ?, ?, ?)", existing_bookings())
    return db


def _free(db: sqlite3.Connection, room: str, day: str, start: int, end: int, ignore: str = "") -> bool:
    clash = db.execute("SELECT 1 FROM bookings WHERE room = ? AND day = ? AND start < ? AND end > ? AND id != ?",
                       (room, day, end, start, ignore)).fetchone()
    return clash is None


def _check_slot(day: str, start_hour: int, hours: int) -> None:
    if not OPEN <= start_hour < CLOSE or hours < 1 or start_hour + hours > CLOSE:
        raise ToolError(f"rooms are bookable {OPEN}:00-{CLOSE}:00; {start_hour}:00 for {hours}h is outside")


def find_rooms(day: Day, start_hour: int, hours: int, attendees: int, state: sqlite3.Connection) -> str:
    """List the rooms free for a whole slot with enough seats, smallest first.

    Args:
        day: the weekday
        start_hour: the hour the meeting starts, 8 to 17 (24-hour clock)
        hours: how many hours it lasts
        attendees: how many people must fit
    """
    _check_slot(day, start_hour, hours)
    free = [name for name, seats in sorted(ROOMS.items(), key=lambda r: r[1])
            if seats >= attendees and _free(state, name, day, start_hour, start_hour + hours)]
    return json.dumps({"free": free})


def book_room(room: str, day: Day, start_hour: int, hours: int, title: str, state: sqlite3.Connection) -> str:
    """Book a room for a meeting.

    Args:
        room: the room's name, e.g. "Cedar"
        day: the weekday
        start_hour: the hour the meeting starts (24-hour clock)
        hours: how many hours it lasts
        title: the meeting's title
    """
    if room not in ROOMS:
        raise ToolError(f"no room '{room}'; rooms: {', '.join(ROOMS)}")
    _check_slot(day, start_hour, hours)
    if not _free(state, room, day, start_hour, start_hour + hours):
        raise ToolError(f"{room} is taken on {day} at some point between {start_hour}:00 and {start_hour + hours}:00")
    n = state.execute("SELECT COUNT(*) FROM bookings").fetchone()[0]
    booking = f"B-{900 + n}"
    state.execute("INSERT INTO bookings VALUES (?, ?, ?, ?, ?, ?)",
                  (booking, room, day, start_hour, start_hour + hours, title))
    return json.dumps({"booking": booking, "room": room, "day": day, "start": start_hour, "end": start_hour + hours})


def my_bookings(title: str, state: sqlite3.Connection) -> str:
    """Find the week's bookings whose title is this one.

    Args:
        title: the meeting's title, e.g. "Budget sync"
    """
    rows = state.execute("SELECT id, room, day, start, end FROM bookings WHERE lower(title) = lower(?) "
                         "ORDER BY id", (title,)).fetchall()
    return json.dumps([{"booking": r[0], "room": r[1], "day": r[2], "start": r[3], "end": r[4]} for r in rows])


def cancel_booking(booking: str, state: sqlite3.Connection) -> str:
    """Cancel a booking.

    Args:
        booking: the booking's id, e.g. "B-104"
    """
    if state.execute("DELETE FROM bookings WHERE id = ?", (booking,)).rowcount == 0:
        raise ToolError(f"no booking '{booking}'")
    return json.dumps({"cancelled": booking})


# --- tasks: a seeded generator ------------------------------------------------------------------------------

def _book_task(rng: random.Random, db: sqlite3.Connection) -> tuple[str, dict] | None:
    day, start, hours = rng.choice(DAYS), rng.randrange(OPEN, CLOSE - 1), rng.choice((1, 1, 2))
    people, title = rng.choice((3, 4, 5, 6, 8, 10, 15)), rng.choice(TITLES)
    if not json.loads(find_rooms(day, start, hours, people, db))["free"]:
        return None
    prompt = (f"Please book a room for {people} people on {DAY_NAMES[day]} at {start}:00 for {hours} "
              f"hour{'s' * (hours > 1)}. The meeting is called \"{title}\".")
    return prompt, {"kind": "book", "day": day, "start": start, "end": start + hours, "people": people,
                    "title": title}


def _cancel_task(rng: random.Random, rows: list) -> tuple[str, dict]:
    booking, room, day, start, _end, title = rng.choice(rows)
    prompt = f"Cancel the \"{title}\" meeting in {room} on {DAY_NAMES[day]} at {start}:00, it is not happening."
    return prompt, {"kind": "cancel", "cancelled": booking}


def all_tasks() -> list[tuple[str, dict, str]]:
    """Every task (prompt, answer, slice): 80 bookings and 40 cancellations, the same list for any seed."""
    rng, db, rows = random.Random(11), fresh_calendar(None), existing_bookings()
    unique = [r for r in rows if sum((x[1], x[2], x[3], x[5]) == (r[1], r[2], r[3], r[5]) for x in rows) == 1]
    out, seen = [], set()
    while len(out) < 120:
        made = _book_task(rng, db) if len(out) < 80 else _cancel_task(rng, unique)
        if made and made[0] not in seen:
            seen.add(made[0])
            out.append((*made, made[1]["kind"]))
    db.close()
    return out


def generate(seed: int) -> Iterator[Task]:
    """The tasks in a seeded order; every fourth of the list is held out (90 train, 30 held-out)."""
    tasks = [Task(task_id=f"rooms-{i}", env="rooms", prompt=[{"role": "user", "content": prompt}],
                  answer=json.dumps(answer), slice=kind, split="heldout" if i % 4 == 3 else "train")
             for i, (prompt, answer, kind) in enumerate(all_tasks())]
    random.Random(seed).shuffle(tasks)
    yield from tasks


# --- rubric ---------------------------------------------------------------------------------------------------

def calendar_right(task: Task, messages: list[dict], state: sqlite3.Connection) -> float:
    """1 when the calendar changed exactly as asked: one new booking that fits, or the one booking cancelled."""
    before = {r[0] for r in existing_bookings()}
    now = {r[0]: r for r in state.execute("SELECT id, room, day, start, end, title FROM bookings")}
    added, removed = set(now) - before, before - set(now)
    want = task.data
    if want["kind"] == "cancel":
        return float(removed == {want["cancelled"]} and not added)
    if removed or len(added) != 1:
        return 0.0
    _id, room, day, start, end, title = now[added.pop()]
    return float((day, start, end) == (want["day"], want["start"], want["end"]) and ROOMS[room] >= want["people"]
                 and title.strip().lower() == want["title"].lower())


# --- scripted solver ------------------------------------------------------------------------------------------

def solve(messages: list[dict], state: sqlite3.Connection) -> dict:
    """Find a free room and book the smallest, or find the meeting and cancel it; then say what was done."""
    ask = next(m["content"] for m in messages if m["role"] == "user")
    results = [json.loads(m["content"]) for m in messages if m["role"] == "tool" and m["content"][:1] in "[{"]
    day = next(d for d, name in DAY_NAMES.items() if name in ask)
    start = int(re.search(r"at (\d+):00", ask).group(1))
    title = re.search(r"\"([^\"]+)\"", ask).group(1)
    if ask.startswith("Cancel"):
        if not results:
            return _call("my_bookings", {"title": title})
        if "cancelled" in results[-1]:
            return _say(f"Cancelled {results[-1]['cancelled']}.")
        room = re.search(r"meeting in (\w+)", ask).group(1)
        match = next(b for b in results[-1] if (b["room"], b["day"], b["start"]) == (room, day, start))
        return _call("cancel_booking", {"booking": match["booking"]})
    people = int(re.search(r"for (\d+) people", ask).group(1))
    hours = int(re.search(r"for (\d+) hour", ask).group(1))
    if not results:
        return _call("find_rooms", {"day": day, "start_hour": start, "hours": hours, "attendees": people})
    if "free" in results[-1]:
        return _call("book_room", {"room": results[-1]["free"][0], "day": day, "start_hour": start, "hours": hours,
                                   "title": title})
    done = results[-1]
    return _say(f"Booked {done['room']} on {DAY_NAMES[day]} {start}:00-{done['end']}:00 ({done['booking']}).")


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def make_env() -> Env:
    """The meeting-room desk."""
    return Env(name="rooms", tools=[find_rooms, book_room, my_bookings, cancel_booking], tasks=generate,
               rewards=[Reward(calendar_right, weight=1.0)], passed=1.0, setup=fresh_calendar,
               teardown=sqlite3.Connection.close, solver=solve)
