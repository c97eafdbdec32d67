"""Which calls changed something, and whether a conversation made the writes its record requires.

A tool is a write when the pipeline says so (`replay.writes`), or when the logs' expected actions name it; a tool
in `replay.reads`, or whose name matches `replay.read_pattern` (look-ups), never is, nor are `think` and
calculators (the default `reads`). Without either list or any expected action, every tool the pattern does not
call a look-up is a write (the fallback). A call whose result was an error changed nothing: it is no write, in
the record or in the model's conversation.

Arguments are compared by a rule per tool argument (`replay.arguments`, keys `tool.argument` or `argument`):
`exact` (the JSON value as written), `normalised` (case, spacing, number formats: matching.normalise), `judge`
(the model of `replay.judge` says whether the two say the same) or `ignore`. Unnamed arguments take
`normalised`, free text (five words or more) `replay.free_text`.

A record with expected actions whose rewarded conversation contradicts them (an expected write never made, a
write made that no expected action names, or the two with other arguments) is scored by what the two agree
on: the writes both hold are required, with the arguments both give; a recorded write the label lacks is
allowed but not required; an expected one never made is not required. `agreement` says what disagreed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from flywheel.contract import Task
from flywheel.envs.replay.matching import normalise

ARGUMENT_TEMPLATE = """You compare two values of one argument of a tool call an assistant made.

The tool and argument: {prompt}
The accepted value: {answer}
The value to judge: {final}

Do the two say the same thing for what the tool does with it (the wording may differ)? Reply with a short
reason, then a last line `SCORE: x` where x is 1 (the same) or 0 (different)."""

ERROR_RESULT = re.compile(r"\s*[\"'{\[]*\s*(error|exception|failed)\b", re.IGNORECASE)
_WORD = re.compile(r"[^\W\d_]{2,}")


def errored(result: str | None) -> bool:
    """Whether a tool result says the call failed (so it changed nothing)."""
    return bool(result) and bool(ERROR_RESULT.match(str(result)))


def free_text(value) -> bool:
    """A string of five words or more: text an agent writes in its own words, not an id, a date, an amount or a
    short option ("no longer needed")."""
    return isinstance(value, str) and len(_WORD.findall(value)) >= 5


@dataclass(frozen=True)
class WriteRules:
    """The pipeline's rules: which tools write, how each argument compares."""

    writes: frozenset[str] = frozenset()
    reads: frozenset[str] = frozenset()
    read_pattern: re.Pattern = re.compile("(?!)")
    arguments: dict[str, str] = field(default_factory=dict)
    free_text: str = "ignore"
    judge: object = None  # a JudgeReward with ARGUMENT_TEMPLATE, for the `judge` rule

    @classmethod
    def from_config(cls, cfg, judge=None) -> WriteRules:
        return cls(frozenset(cfg.writes), frozenset(cfg.reads), re.compile(f"(?:{cfg.read_pattern})", re.IGNORECASE),
                   dict(cfg.arguments), cfg.free_text, judge)

    def is_write(self, name: str, named: frozenset[str] | set[str]) -> bool:
        """Whether calls of `name` change state; `named`: the tools the logs' expected actions name."""
        if name in self.writes:
            return True
        if name in self.reads or self.read_pattern.match(name):
            return False
        if self.writes or named:
            return name in named
        return True

    def rule(self, tool: str, argument: str, *values) -> str:
        """How this argument of this tool is compared (free text when any of the values compared is)."""
        given = self.arguments.get(f"{tool}.{argument}") or self.arguments.get(argument)
        if given:
            return given
        return self.free_text if any(free_text(v) for v in values) else "normalised"

    def same(self, tool: str, argument: str, want, got) -> bool:
        """Whether a value matches the wanted one under its rule."""
        rule = self.rule(tool, argument, want, got)
        if rule == "ignore":
            return True
        if rule == "exact":
            return json.dumps(want, sort_keys=True) == json.dumps(got, sort_keys=True)
        if rule == "judge" and normalise(want) != normalise(got):
            asked = Task("argument", "replay", [{"role": "user", "content": f"{tool}.{argument}"}],
                         json.dumps(want, ensure_ascii=False), "")
            return self.judge(asked, [{"role": "assistant", "content": str(got)}]) >= 0.5
        return normalise(want) == normalise(got)

    def checked(self, tool: str, arguments: dict) -> list[str]:
        """The arguments of a call that its rules compare (not `ignore`), in order."""
        return [k for k, v in arguments.items() if self.rule(tool, k, v) != "ignore"]


@dataclass(frozen=True)
class Want:
    """A write the rubric requires: a tool and the arguments it must have (others are free)."""

    name: str
    arguments: dict


@dataclass
class Agreement:
    """What a record's expected actions and its rewarded conversation agree on, and where they do not."""

    required: list[Want]
    allowed: list[str]  # tools of recorded writes the label lacks: the model may make them, need not
    disputes: list[str]  # each disagreement, in words


def recorded_writes(calls, rules: WriteRules, named) -> list[Want]:
    """The writes a recorded conversation made: calls of write tools whose result was no error."""
    return [Want(name, dict(arguments)) for name, arguments, result in calls
            if rules.is_write(name, named) and not errored(result)]


def agreement(expected: list | None, recorded: list[Want], rules: WriteRules, named) -> Agreement:
    """What the rubric requires: the recorded writes without expected actions; with them, what both agree on."""
    if expected is None:
        return Agreement(recorded, [], [])
    wanted = [Want(name, dict(arguments)) for name, arguments in expected if rules.is_write(name, named)]
    free = list(range(len(recorded)))
    required, disputes = [], []
    for want in wanted:
        same_tool = [i for i in free if recorded[i].name == want.name]
        if not same_tool:
            disputes.append(f"expected {want.name} was never made")
            continue
        best = max(same_tool, key=lambda i: _agreeing(want, recorded[i], rules))
        free.remove(best)
        made = recorded[best]
        kept = {k: v for k, v in want.arguments.items() if k in made.arguments
                and rules.same(want.name, k, v, made.arguments[k])}
        differ = sorted(k for k in want.arguments if k not in kept and rules.rule(want.name, k, want.arguments[k])
                        != "ignore")
        if differ:
            disputes.append(f"{want.name} made with other {', '.join(differ)} than expected")
        required.append(Want(want.name, kept))
    allowed = [recorded[i].name for i in free]
    disputes += [f"{name} made, not expected" for name in allowed]
    return Agreement(required, allowed, disputes)


def _agreeing(want: Want, made: Want, rules: WriteRules) -> int:
    return sum(k in made.arguments and rules.same(want.name, k, v, made.arguments[k])
               for k, v in want.arguments.items())


def model_writes(scored: list[dict], rules: WriteRules, named) -> list[tuple[str, dict | None]]:
    """The writes in a scored part of a conversation: calls of write tools whose result was no error (arguments
    None when they are not a JSON object)."""
    results = {m.get("tool_call_id"): m.get("content") for m in scored if m.get("role") == "tool"}
    out = []
    for message in scored:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            name = (call.get("function") or {}).get("name", "")
            if not rules.is_write(name, named) or errored(results.get(call.get("id"))):
                continue
            try:
                arguments = json.loads((call.get("function") or {}).get("arguments") or "{}")
            except json.JSONDecodeError:
                arguments = None
            out.append((name, arguments if isinstance(arguments, dict) else None))
    return out


def writes_match(required: list[Want], allowed: list[str], made: list[tuple[str, dict | None]],
                 rules: WriteRules) -> float:
    """1 when every required write was made (order free, each once) and every other write is an allowed one."""
    left = list(required)
    spare = list(allowed)
    for name, arguments in made:
        hit = None if arguments is None else next(
            (w for w in left if w.name == name and all(
                k in arguments and rules.same(name, k, v, arguments[k]) for k, v in w.arguments.items())), None)
        if hit is not None:
            left.remove(hit)
        elif name in spare:
            spare.remove(name)
        else:
            return 0.0
    return 0.0 if left else 1.0
