"""The support desk's database: users, their orders and payments, refunds and tickets, generated from a seed.

Every episode gets its own in-memory copy (`fresh`), deserialised from one image of the seed's database built
once per process: episodes never see each other's writes, and a copy costs microseconds, not a rebuild.
"""

from __future__ import annotations

import random
import sqlite3
import threading

FIRST = ["ana", "ben", "cara", "dan", "eva", "finn", "gia", "hugo", "ida", "jon", "kim", "leo", "mia", "noah",
         "olga", "paul", "rosa", "sam", "tara", "uma", "vic", "will", "yara", "zoe"]
LAST = ["lee", "kim", "diaz", "park", "shaw", "ross", "cole", "hale", "wu", "ng", "roy", "fox", "ray", "bell"]
STATUSES = ["pending", "shipped", "delivered", "cancelled"]
STATUS_WEIGHTS = [4, 2, 3, 1]
SPEEDS = ["standard", "express"]
USERS = 120

SCHEMA = """
CREATE TABLE users (user_id TEXT PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL UNIQUE);
CREATE TABLE orders (order_id TEXT PRIMARY KEY, user_id TEXT NOT NULL REFERENCES users, status TEXT NOT NULL,
                     total_cents INTEGER NOT NULL, shipping TEXT NOT NULL, payment TEXT NOT NULL);
CREATE TABLE refunds (order_id TEXT PRIMARY KEY REFERENCES orders, amount_cents INTEGER NOT NULL,
                      payment TEXT NOT NULL);
CREATE TABLE tickets (ticket_id TEXT PRIMARY KEY, order_id TEXT NOT NULL REFERENCES orders, reason TEXT NOT NULL);
"""
# the tables an episode may change, and the order their rows are compared in
TABLES = {"orders": "order_id", "refunds": "order_id", "tickets": "ticket_id"}

_IMAGES: dict[int, bytes] = {}
_LOCK = threading.Lock()


def build(seed: int) -> sqlite3.Connection:
    """A new database of USERS users with 1-3 orders each, the same for the same seed."""
    rng = random.Random(f"support-db:{seed}")
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(SCHEMA)
    names = rng.sample([(f, last) for f in FIRST for last in LAST], USERS)
    order_ids = rng.sample(range(1000, 10000), USERS * 3)
    for i, (first, last) in enumerate(names):
        user_id = f"U{100 + i}"
        db.execute("INSERT INTO users VALUES (?, ?, ?)", (user_id, f"{first.title()} {last.title()}",
                                                         f"{first}.{last}@mail.com"))
        payment = f"{rng.choice(['card', 'gift'])}-{rng.randint(1000, 9999)}"
        for _ in range(rng.randint(1, 3)):
            db.execute("INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?)",
                       (f"W{order_ids.pop()}", user_id, rng.choices(STATUSES, STATUS_WEIGHTS)[0],
                        rng.randint(500, 40000), rng.choice(SPEEDS), payment))
    db.commit()
    return db


def fresh(seed: int) -> sqlite3.Connection:
    """An episode's own copy of the seed's database (in memory, usable from the harness's tool threads)."""
    with _LOCK:
        if seed not in _IMAGES:
            _IMAGES[seed] = build(seed).serialize()
        image = _IMAGES[seed]
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.deserialize(image)
    return db


def snapshot(db: sqlite3.Connection) -> dict[str, list[tuple]]:
    """Every row of the tables an episode may write, in key order: two databases agree iff their snapshots do."""
    return {table: db.execute(f"SELECT * FROM {table} ORDER BY {key}").fetchall() for table, key in TABLES.items()}


def money(cents: int) -> str:
    """Cents as the desk writes amounts: 4520 -> '45.20'."""
    return f"{cents // 100}.{cents % 100:02d}"
