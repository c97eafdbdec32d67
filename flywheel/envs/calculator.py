"""The calculator environment: integer arithmetic questions, a safe `calculator` tool, an exact-answer rubric.

Written on the SDK (flywheel/envs/sdk.py) like any user's environment.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Iterator
from functools import lru_cache, partial

from flywheel.contract import Task, ToolError, prompt_hash
from flywheel.envs.sdk import Env, Reward

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_ABS = 1e18

# The one definition of "an arithmetic expression in user text"; solve and task_from_messages both use it.
EXPRESSION = re.compile(r"-?[(\d][\d\s()+*/%-]*[\d)]")
NUMBER = re.compile(r"-?\d+")

PHRASINGS = ["What is {}?", "Compute {}.", "Calculate {}", "What's {}?", "Work out {}.", "Evaluate {}.",
             "How much is {}?", "{} = ?"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "use only numbers, + - * / // % ** and parentheses"


def evaluate(expression: str) -> int | float:
    """Evaluate arithmetic safely (an ast walk, never eval); anything else is a ToolError."""
    if not isinstance(expression, str):
        raise ToolError("'expression' must be a string")
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression is {len(expression)} characters long; the limit is {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as err:
        raise ToolError(f"not an arithmetic expression ({getattr(err, 'msg', err)}); {_ALLOWED}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    # type() not isinstance(): bool is an int subclass and True/False are not numbers here
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large; the limit is {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result is too large; the limit is {MAX_ABS:g}") from None
    if isinstance(node, ast.Constant):
        raise ToolError(f"{node.value!r} is not a number; {_ALLOWED}")
    raise ToolError(f"{ast.unparse(node)[:40]!r} is not allowed ({type(node).__name__}); {_ALLOWED}")


def _bounded(value: object) -> int | float:
    if type(value) not in (int, float):  # e.g. a complex number from (-8) ** 0.5
        raise ToolError(f"result {value!r} is not a real number")
    if not math.isfinite(value) or abs(value) > MAX_ABS:
        raise ToolError(f"result is too large; the limit is {MAX_ABS:g}")
    return value


def format_number(value: float) -> str:
    """Integers (and integral floats) without '.0', other floats by repr."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def find_expression(text: str) -> str | None:
    """The longest run of arithmetic in the text that has an operator, or None."""
    candidates = [m.strip() for m in EXPRESSION.findall(text) if re.search(r"[-+*/%]", m)]
    return max(candidates, key=len) if candidates else None


def slice_of(expression: str) -> str:
    """The difficulty slice: an operand of 3+ digits 'big', else 3+ operands 'mixed', 'mul' with a product, 'add'."""
    operands = re.findall(r"\d+", expression)
    if any(len(o) >= 3 for o in operands):
        return "big"
    if len(operands) >= 3:
        return "mixed"
    return "mul" if "*" in expression else "add"


def _text(content: object) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _first_user_text(messages: list[dict]) -> str | None:
    return next((_text(m.get("content")) for m in messages if m.get("role") == "user"), None)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses).

    Args:
        expression: e.g. 37 * 12 + 5
    """
    return format_number(evaluate(expression))


def generate_tasks(seed: int, big_fraction: float = 0.0, big_max: int = 999) -> Iterator[Task]:
    """An endless seeded stream of questions, slices 'add', 'mul' and 'mixed' in equal shares.

    big_fraction: the share of 'big' questions instead, a product or sum of 2-3 operands up to big_max
    (results of 5-8 digits): a harder slice, since the student must copy a long tool result exactly.
    """
    rng = random.Random(seed)
    while True:
        if big_fraction and rng.random() < big_fraction:
            expression = _big_expression(rng, big_max)
        else:
            expression = _expression(rng)
        prompt = [{"role": "user", "content": rng.choice(PHRASINGS).format(expression)}]
        yield _task(prompt, expression, evaluate(expression))


def _expression(rng: random.Random) -> str:
    kind = rng.choice(["add", "mul", "mixed"])
    a, b, c = (rng.randint(1, 99) for _ in range(3))
    if kind == "add":
        return f"{a} {rng.choice('+-')} {b}"
    if kind == "mul":
        return f"{a} * {b}"
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    return rng.choice([f"{a} {op1} {b} {op2} {c}", f"({a} {op1} {b}) {op2} {c}", f"{a} {op1} ({b} {op2} {c})"])


def _big_expression(rng: random.Random, big_max: int) -> str:
    a, b, c = rng.randint(100, big_max), rng.randint(10, big_max), rng.randint(10, 99)
    return rng.choice([f"{a} * {b}", f"{a} * {b} + {c}", f"({a} + {c}) * {b}", f"{a} * {b} - {c}"])


def task_from_messages(messages: list[dict]) -> Task | None:
    """The task behind a conversation: the first user message, if it holds an integer expression."""
    text = _first_user_text(messages)
    return _task_of_text(text) if text else None


@lru_cache(maxsize=1 << 16)
def _task_of_text(text: str) -> Task | None:
    # kept per text: an agent's users ask the same questions again and again, and collect makes a task of every
    # trace (frozen Tasks; their prompts are read, never changed)
    expression = find_expression(text)
    solved = None if expression is None else _solved(expression)
    if solved is None:
        return None
    answer, slice_ = solved
    prompt = [{"role": "user", "content": text}]
    return Task(task_id=prompt_hash(prompt), env="calculator", prompt=prompt, answer=answer, slice=slice_)


@lru_cache(maxsize=1 << 16)
def _solved(expression: str) -> tuple[str, str] | None:
    """An expression's answer (JSON text) and slice, or None if it fails or is no integer; kept per expression:
    the same sums come in many wordings (evaluating is half the cost of making a trace's task)."""
    try:
        value = evaluate(expression)
    except ToolError:
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return _answer(expression, value), slice_of(expression)


def _task(prompt: list[dict], expression: str, value: float) -> Task:
    return Task(task_id=prompt_hash(prompt), env="calculator", prompt=prompt, answer=_answer(expression, value),
                slice=slice_of(expression))


def _answer(expression: str, value: float) -> str:
    return json.dumps({"expression": expression, "value": int(value)})


def answer(task: Task, messages: list[dict]) -> float:
    """1 if the final answer's last number is the right value, else 0: the reward."""
    last = messages[-1] if messages else {}
    answered = last.get("role") == "assistant" and not last.get("tool_calls")
    # "1,234" is one number to a reader, so drop thousands separators before reading numbers
    numbers = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", _text(last.get("content")))) if answered else []
    return float(bool(numbers) and int(numbers[-1]) == task.data["value"])


def exact_answer(task: Task, messages: list[dict]) -> float:
    """Audit: the final answer states one number, the right one (a list of guesses does not pass)."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0
    numbers = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", _text(last.get("content"))))
    return float(len(numbers) == 1 and int(numbers[0]) == task.data["value"])


def used_tool(task: Task, messages: list[dict]) -> float:
    """1 if the agent called the calculator at all (logged, not rewarded)."""
    return float(any(c.get("function", {}).get("name") == "calculator"
                     for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []))


def valid_tool_calls(task: Task, messages: list[dict]) -> float:
    """The share of tool results that are not errors (logged, not rewarded)."""
    results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
    return sum(not r.startswith("Error:") for r in results) / len(results) if results else 1.0


def solve(messages: list[dict]) -> dict:
    """Call the calculator on the question's expression, then state its result (or an own computation)."""
    expression = find_expression(_first_user_text(messages) or "")
    if expression is None:
        return {"role": "assistant", "content": "I could not find an arithmetic expression in the question."}
    results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
    if not results:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]}
    result = results[-1]
    if result.startswith("Error:"):  # the tool failed (timeout, bad call): the oracle still knows the sum
        try:
            result = format_number(evaluate(expression))
        except ToolError as err:
            return {"role": "assistant", "content": f"I cannot compute that: {err}."}
    return {"role": "assistant", "content": f"The answer is {result}."}


class CalculatorEnv(Env):
    """Arithmetic with 2-3 operands up to 99 (and a share of bigger ones) that the agent should hand to the tool.

    Stateless; the reward is the answer alone, `used_tool` and `valid_tool_calls` are logged with weight 0; the
    audit (the RL monitor's) asks for exactly one number in the answer, the right one.
    A class (not only make_env) so that tests can subclass it.
    """

    def __init__(self, big_fraction: float = 0.0, big_max: int = 999):
        if not 0.0 <= big_fraction <= 1.0 or big_max < 100:
            raise ValueError(f"calculator: big_fraction must be in [0, 1] (got {big_fraction}) and big_max at least "
                             f"100 (got {big_max})")
        # a partial, not a lambda: the environment is pickled into RL actor processes
        tasks = partial(generate_tasks, big_fraction=big_fraction, big_max=big_max) if big_fraction else generate_tasks
        super().__init__(name="calculator", tools=[calculator], tasks=tasks,
                         rewards=[Reward(answer), Reward(used_tool, weight=0.0), Reward(valid_tool_calls, weight=0.0)],
                         passed=1.0, solver=solve, task_from_messages=task_from_messages, audits=[exact_answer])


def make_env(big_fraction: float = 0.0, big_max: int = 999) -> Env:
    """The calculator environment (`environment: {name: calculator, args: {big_fraction: 0.3}}`)."""
    return CalculatorEnv(big_fraction, big_max)


ENVIRONMENT = make_env
