"""Personal data and secrets replaced by typed placeholders (`<EMAIL>`, `<API_KEY>`) before anything is written."""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Callable

from flywheel.config import RedactionConfig


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return 13 <= len(digits) <= 19 and total % 10 == 0


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# kind -> (regex, a check a candidate must pass, or None). Order matters where two could match at one place:
# a card number is also a run of digit groups a phone pattern would take.
_BUILTIN: dict[str, list[tuple[str, Callable[[str], bool] | None]]] = {
    "private_key": [(r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z]+ )*PRIVATE KEY-----", None)],
    "api_key": [
        (r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}", None),  # OpenAI, Anthropic
        (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", None),  # AWS access key ids
        (r"\bAIza[0-9A-Za-z_-]{35}", None),  # Google
        (r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})", None),  # GitHub
        (r"\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}", None),  # Stripe
        (r"\bhf_[A-Za-z0-9]{30,}", None),  # Hugging Face
    ],
    "token": [
        (r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}", None),  # JWT
        (r"\bxox[abposr]-[A-Za-z0-9-]{10,}", None),  # Slack
        (r"(?i:\bbearer\s+)[A-Za-z0-9._~+/-]{16,}=*", None),
        # `password: ...`, "api_key": "...", secret=...: the value, whatever its format
        ((r"""(?i:\b(?:api[_-]?key|secret|token|password|passwd|access[_-]?key)\b["']?\s*[:=]\s*["']?)"""
          r"""[^\s"',;]{8,}"""), None),
    ],
    "email": [(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b", None)],
    "credit_card": [(r"(?<![\w.])\d(?:[ -]?\d){12,18}(?![\w.])", lambda s: _luhn(re.sub(r"\D", "", s)))],
    "ip_address": [
        (r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])", _is_ip),
        (r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:|::)(?:[0-9A-Fa-f]{0,4}:){1,6}[0-9A-Fa-f]{0,4}(?![\w:])", _is_ip),
    ],
    # Needs separators (or a leading +): bare digit runs are numbers far more often than phones.
    "phone": [((r"(?<![\w.+-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,5}(?![\w-])"
                r"|(?<![\w+])\+\d{8,15}\b"), None)],
}
# A cheap test per kind: a string is searched only for the kinds whose test it passes (one regex of ~20
# alternatives over every string costs ~6x more).
_GATES: dict[str, Callable[[str], bool]] = {
    "private_key": lambda s: "PRIVATE KEY" in s,
    "api_key": re.compile(r"sk-|AKIA|ASIA|AIza|gh[pousr]_|github_pat_|k_live_|k_test_|hf_").search,
    "token": lambda s: "eyJ" in s or "xox" in s or _secret_word(s.lower()),
    "email": lambda s: "@" in s,
    "credit_card": re.compile(r"\d(?:[ -]?\d){12}").search,
    "ip_address": lambda s: "::" in s or _IP_GATE(s) is not None,
    "phone": re.compile(r"\d[ .-]\d{3,4}[ .-]\d{3}|\)[ .-]?\d{3,4}[ .-]\d{3}|\+\d{8}").search,
}


def _secret_word(lowered: str) -> bool:
    # lowered once, not once per word; the words spelled out, as a generator over them costs twice as much
    return ("bearer" in lowered or "key" in lowered or "secret" in lowered or "token" in lowered
            or "passw" in lowered or "access" in lowered)
# three dots between digits, or three colons (two would be any time of day); each starts with a literal, which
# the regex engine finds fast (a leading character class is tried at every position of a whole JSON record)
_IP_GATE = re.compile(r"\.\d{1,3}\.\d{1,3}\.\d|:[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:").search
# needed() looks at whole records, where the digit kinds' gates would start a match at every digit (ids,
# dates, numbers): it runs them only on the runs of digits and separators at least 7 long (every phone, card
# number and IPv4 address lies in one), found in one pass: half the cost
_DIGIT_RUNS = re.compile(r"[\d .()+-]{7,}").findall
_IN_RUNS: dict[str, Callable[[str], bool]] = {
    "credit_card": _GATES["credit_card"],
    "phone": _GATES["phone"],
    "ip_address": re.compile(r"\d\.\d{1,3}\.\d{1,3}\.\d").search,  # IPv6 (colons) is searched whole
}
_IPV6_GATE = re.compile(r":[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:").search
# The lead-in of an assignment or a bearer header is kept; only the secret after it is replaced.
_KEEP_LEAD = re.compile(r"""(?i)^(?:bearer\s+|[\w-]+["']?\s*[:=]\s*["']?)""")


CLEAN_CHARS = 5_000_000  # how much clean text a Redactor remembers (needed_in): some tens of MB at most


class Redactor:
    """Typed placeholders for every match; counts per kind. Kinds whose cheap test fails are not searched."""

    def __init__(self, cfg: RedactionConfig):
        # Custom patterns first (a team's own formats win over the generic ones), and always searched.
        self._custom = [(name, _scoped_flags(pattern), None) for name, pattern in cfg.patterns.items()]
        self._kinds = [kind for kind in _BUILTIN if kind in cfg.kinds]
        self._compiled: dict[tuple[str, ...], tuple[re.Pattern | None, list]] = {}
        self.counts: Counter[str] = Counter()
        self._seen: dict[str, tuple[str, Counter]] = {}  # prompts, tool schemas and outputs repeat a lot
        self._clean: dict[str, None] = {}  # strings no gate passed: tool lists' text, system prompts, ...
        self._clean_chars = 0

    def needed_in(self, *values) -> bool:
        """Whether `self.value` would change any string of these values; False is certain.

        The strings not known clean are gated as one text, joined by newlines (no gate's pattern spans a line
        break, and a gate that passes on a string passes on any text holding it); when none passes, they are
        remembered as clean (up to CLEAN_CHARS characters in all, then forgotten at once), so the strings
        records repeat (tool lists' text, system prompts, roles) are gated once, not once a record.
        """
        fresh: list[str] = []
        _strings(values, fresh, self._clean)
        if not fresh:
            return False
        if self.needed("\n".join(fresh)):
            return True
        if self._clean_chars > CLEAN_CHARS:
            self._clean.clear()
            self._clean_chars = 0
        for text in fresh:
            self._clean[text] = None
            self._clean_chars += len(text)
        return False

    def needed(self, text: str) -> bool:
        """Whether anything in this text (e.g. a whole JSON record) may need redacting; False is certain."""
        # JSON may escape any character (\u0040 is @): such text is searched string by string
        if self._custom or "\\u" in text:
            return True
        runs = None
        for kind in self._kinds:
            if kind in _IN_RUNS:
                runs = _DIGIT_RUNS(text) if runs is None else runs
                if any(_IN_RUNS[kind](run) for run in runs):
                    return True
                if kind == "ip_address" and ("::" in text or _IPV6_GATE(text)):
                    return True
            elif _GATES[kind](text):
                return True
        return False

    def kinds_in(self, text: str) -> tuple[str, ...]:
        """The built-in kinds that may occur in this text (a superset: the regexes decide)."""
        return tuple(kind for kind in self._kinds if _GATES[kind](text))

    def text(self, value: str) -> str:
        """The string with every match replaced by its kind's placeholder."""
        if not value:
            return value
        if value in self._seen:
            result, counts = self._seen[value]
            self.counts.update(counts)
            return result
        regex, rules = self._regex(self.kinds_in(value))
        if regex is None:
            result, counts = value, Counter()
        else:
            before = self.counts.copy()
            result = regex.sub(lambda match: self._replace(match, rules), value)
            counts = self.counts - before
        if len(value) <= 2000:
            if len(self._seen) >= 100_000:
                self._seen.clear()
            self._seen[value] = (result, counts)
        return result

    def value(self, value):
        """Strings anywhere inside JSON-like data, redacted; everything else unchanged."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        return value

    def _regex(self, kinds: tuple[str, ...]) -> tuple[re.Pattern | None, list]:
        if kinds not in self._compiled:
            rules = self._custom + [(kind, p, check) for kind in kinds for p, check in _BUILTIN[kind]]
            joined = "|".join(f"(?P<r{i}>{pattern})" for i, (_, pattern, _) in enumerate(rules))
            self._compiled[kinds] = (re.compile(joined) if rules else None,
                                     [(kind, check, f"<{kind.upper()}>") for kind, _, check in rules])
        return self._compiled[kinds]

    def _replace(self, match: re.Match, rules: list) -> str:
        kind, check, placeholder = rules[int(match.lastgroup[1:])]
        found = match.group()
        if check is not None and not check(found):
            return found
        if kind == "token":
            lead = _KEEP_LEAD.match(found)
            if lead and lead.end() < len(found):
                secret = found[lead.end():]
                inner = self.text(secret)  # a known format (an API key, an email) keeps its own kind
                if inner != secret:
                    return found[: lead.end()] + inner
                self.counts[kind] += 1
                return found[: lead.end()] + placeholder
        self.counts[kind] += 1
        return placeholder


def _strings(values, out: list[str], known: dict[str, None]) -> None:
    """Every string inside these JSON-like values that is not in `known`, appended to `out` (in no set order;
    dict keys are no values). A loop over a stack, not recursion: a call per node would cost twice the gate."""
    stack = list(values)
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is str:
            if value and value not in known:
                out.append(value)
        elif kind is dict:
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)
        elif isinstance(value, str):  # subclasses: the type checks above are for speed only
            out.append(str(value))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _scoped_flags(pattern: str) -> str:
    """`(?i)abc` -> `(?i:abc)`: flags at the start of one alternative of the combined regex must be scoped."""
    lead = re.match(r"\(\?([aiLmsux]+)\)", pattern)
    return f"(?{lead.group(1)}:{pattern[lead.end():]})" if lead else pattern
