"""Which recorded call a model's call stands for: same tool, the same arguments once normalised.

Normalised: key order does not matter, nor does a null argument left out; strings are compared with their
whitespace collapsed and case folded; a number and its string form are one value ("12.50" == 12.5). Free
text (a string of two words or more) may also match by word overlap when the config allows it (`fuzzy`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Call:
    """One recorded tool call and the result the record gave it."""

    name: str
    arguments: dict
    result: str


def normalise(value):
    """The comparable form of a JSON value (see the module's docstring)."""
    if isinstance(value, dict):
        return {str(k).strip(): normalise(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return _number(str(value)) if value == value else value
    if isinstance(value, str):
        text = " ".join(value.split())
        if _NUMBER.fullmatch(text):
            number = _number(text.replace(",", ""))
            if number is not None:
                return number
        return text.casefold()
    return value


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text).normalize()
    except InvalidOperation:
        return None


def overlap(a: str, b: str) -> float:
    """Jaccard overlap of the two texts' words (case folded)."""
    wa, wb = set(_WORD.findall(a.casefold())), set(_WORD.findall(b.casefold()))
    if not wa and not wb:
        return 1.0
    return len(wa & wb) / len(wa | wb)


def _free_text(value) -> bool:
    # words apart by spaces: "ACC-1003" is an id, one word, matched exactly
    return isinstance(value, str) and len(value.split()) >= 2


def same(recorded, given, fuzzy: float) -> bool:
    """Whether two normalised values match: equal, or free texts overlapping by at least `fuzzy`."""
    if isinstance(recorded, dict) and isinstance(given, dict):
        return recorded.keys() == given.keys() and all(same(recorded[k], given[k], fuzzy) for k in recorded)
    if isinstance(recorded, list) and isinstance(given, list):
        return len(recorded) == len(given) and all(same(r, g, fuzzy) for r, g in zip(recorded, given, strict=True))
    if recorded == given and type(recorded) is type(given):
        return True
    if fuzzy < 1.0 and _free_text(recorded) and _free_text(given):
        return overlap(recorded, given) >= fuzzy
    return False


@dataclass
class Matcher:
    """The recorded calls of one episode; each answers one call of the model (the first unused match first)."""

    calls: list[Call]
    fuzzy: float
    used: list[bool] = field(default_factory=list)
    _normal: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.used = [False] * len(self.calls)
        self._normal = [normalise(c.arguments) for c in self.calls]

    def find(self, name: str, arguments: dict, reuse: bool = True) -> int | None:
        """The index of the recorded call this call matches: an unused exact match, then an unused fuzzy one,
        then (`reuse`) one already used, so a repeated read gets the same answer; None when nothing matches."""
        given = normalise(arguments)
        candidates = [i for i, c in enumerate(self.calls) if c.name == name]
        for exact in (True, False):
            for i in candidates:
                if not self.used[i] and same(self._normal[i], given, 1.0 if exact else self.fuzzy):
                    return i
        if not reuse:
            return None
        return next((i for i in candidates if same(self._normal[i], given, self.fuzzy)), None)

    def answer(self, name: str, arguments: dict) -> str | None:
        """The recorded result of the matching call (marking it used), or None."""
        i = self.find(name, arguments)
        if i is None:
            return None
        self.used[i] = True
        return self.calls[i].result


def describe(name: str, arguments: dict) -> str:
    """A call as the model would read it back: name(JSON arguments), cut short."""
    text = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    return f"{name}({text if len(text) <= 200 else text[:197] + '...'})"
