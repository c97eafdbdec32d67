"""How long each stage will take on this machine, before a run: `flywheel check` prints it, `flywheel run` records
it beside the measured times and holds it against `budget_minutes`.

The inputs are the pipeline's own: its tasks (how many in each split), their conversations in the chosen student's
tokens and template (the scripted solver's on a few train tasks, as the oracle teacher would write them; without a
solver, the prompts and a turn of evaluate's max_new_tokens), SFT's steps (`SFTConfig.planned_steps`: the one place
SFT's length is decided), RL's steps and groups, evaluate's held-out episodes, and the student's speed measured
here (flywheel/train/probe.py). The arithmetic is a sum of (tokens / measured rate) per stage, plus loading the
student; what it leaves out is said in `Estimate.notes`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.agent import Harness
from flywheel.config import PipelineConfig
from flywheel.contract import Task
from flywheel.data.tasksets import own_tasks
from flywheel.metrics import STAGE_ESTIMATE
from flywheel.policies.oracle import OraclePolicy
from flywheel.replaycheck import recorded_conversations
from flywheel.train.context import EVAL_MAX_NEW_TOKENS
from flywheel.train.probe import Speed, measure

STAGES = ("synthesize", "sft", "rl", "evaluate")
SAMPLE_TASKS = 16  # train tasks whose conversations stand for all of them
PADDING_DRAWS = 200  # random batches drawn to find the expected longest row of a batch (what SFT pads to)
# the hf policy's batch (flywheel/policies/hf.py) and SFT validation's (tasks/sft.py); evaluate's is its batch_size
GENERATION_BATCH = 64
# Starting a stage and finishing it: its MLflow run, its outputs written, hashed and committed to DVC (2-4 s a
# stage on the 2-core machine, measured on the small pipeline's collect and register): not measured by the probe.
STAGE_OVERHEAD_S = 3.0


@dataclass(frozen=True)
class Conversations:
    """What the sampled train conversations measure, in the student's tokens."""

    sampled: int  # conversations measured
    lengths: list[int]  # each whole conversation (an SFT example), tokens
    prompt_tokens: float  # the first turn's prompt, mean
    turns: float  # assistant turns per conversation, mean
    tokens_per_turn: float  # tokens an assistant turn writes, mean
    passed: float  # the share the solver's conversations passed (1.0 without a solver)
    solver_s: float | None  # the solver's seconds per episode (None: no solver)
    how: str  # how they were made and counted
    opening: int = 0  # tokens every conversation starts with (system prompt, tools): read once a batch

    @property
    def read_tokens(self) -> float:
        """Tokens an episode reads that it did not write (prompt, tool results, user turns), mean."""
        return max(sum(self.lengths) / self.sampled - self.turns * self.tokens_per_turn, self.prompt_tokens)


@dataclass
class Estimate:
    """Seconds per stage (None: not estimated, with the reason in `inputs`), what each came from, and caveats."""

    pipeline: str
    seconds: dict[str, float | None]
    inputs: dict[str, str]
    speed: Speed | None  # None: nothing to measure it for (no tasks)
    conversations: Conversations | None
    notes: list[str] = field(default_factory=list)
    sft_shape: tuple[int, float] | None = None  # SFT's batch: rows, padded width (the training step render shows)

    @property
    def total(self) -> float:
        """The stages' estimated seconds summed (those not estimated count 0: see `complete`)."""
        return sum(s or 0.0 for s in self.seconds.values())

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.seconds.values())

    def params(self) -> dict[str, float]:
        """The estimate as the pipeline's MLflow run records it: estimate.<stage>_s and estimate.total_s."""
        return {STAGE_ESTIMATE.format(stage=stage): round(s, 1) for stage, s in self.seconds.items()
                if s is not None} | {STAGE_ESTIMATE.format(stage="total"): round(self.total, 1)}


def estimate(name: str, cfg: PipelineConfig, harness: Harness, root: Path, refresh: bool = False) -> Estimate:
    """Each stage's time for pipeline `name` (cfg with `student.model: auto` resolved), at the student's speed
    measured here (or kept from before; `refresh`: measured again)."""
    env = harness.env
    tasks = own_tasks(env, cfg.environment, cfg.collect.heldout_fraction) or list(env.recorded_tasks())
    train = [t for t in tasks if t.split == "train"]
    heldout = [t for t in tasks if t.split == "heldout"]
    synth_tasks = [t for t in train if t.slice not in cfg.synthesize.exclude_slices]
    # the conversations SFT will train on stand for every stage's (synthesize.exclude_slices left out)
    recorded = recorded_conversations(root, name) if cfg.environment.name == "replay" else None
    convs = conversations(cfg, harness, synth_tasks or train, root, recorded) if train else None
    seconds: dict[str, float | None] = {}
    inputs: dict[str, str] = {}
    notes: list[str] = []
    if convs is None:
        reason = "no tasks before collect (they come from traces): run collect, then check again"
        return Estimate(name, dict.fromkeys(STAGES), dict.fromkeys(STAGES, reason), None, None, [reason])
    speed = measure(cfg, root, refresh)
    n = cfg.synthesize.samples_per_task
    teacher = cfg.teacher.policy
    if teacher == "oracle" and convs.solver_s is not None:
        seconds["synthesize"] = len(synth_tasks) * n * convs.solver_s
        inputs["synthesize"] = (f"{len(synth_tasks)} train tasks x {n} sample(s), the solver at "
                                f"{convs.solver_s * 1000:.1f} ms an episode")
    elif teacher == "none":
        seconds["synthesize"], inputs["synthesize"] = 0.0, "no teacher: the accepted traces are the targets"
    else:
        seconds["synthesize"] = None
        inputs["synthesize"] = f"not estimated: a {teacher} teacher's speed is its own, not the student's"
    # targets: the solver's passing share of each task once (its n samples are one conversation: duplicates),
    # a sampling teacher's up to n each (keep_best_only: one)
    per_task = 1 if teacher == "oracle" or cfg.synthesize.keep_best_only else n
    examples = round(len(synth_tasks) * per_task * convs.passed)
    seconds["sft"], inputs["sft"] = _sft(cfg, convs, examples, speed)
    seconds["rl"], inputs["rl"] = _rl(cfg, convs, speed, len(train))
    seconds["evaluate"], inputs["evaluate"] = _evaluate(cfg, convs, len(heldout), speed)
    seconds = {stage: s if s is None or s == 0 else s + STAGE_OVERHEAD_S for stage, s in seconds.items()}
    notes.append(f"each stage {STAGE_OVERHEAD_S:.0f} s to start and finish; rl's actors and learner counted one "
                 "after the other (an actor that overlaps the learner makes it shorter); evaluate leaves out a "
                 "champion and references")
    if cfg.synthesize.include_accepted_traces and teacher != "none":  # (no teacher: they are the examples)
        notes.append("SFT's examples leave out the accepted traces (their number is known after collect)")
    width = sft_width(cfg, convs, sft_split(cfg, examples)[2])
    return Estimate(name, seconds, inputs, speed, convs, notes, (cfg.sft.micro_batch_size(), width))


def conversations(cfg: PipelineConfig, harness: Harness, train: list[Task], root: Path,
                  recorded: dict[str, list[dict]] | None = None) -> Conversations:
    """The solver's conversations on a seeded sample of train tasks, in the student's tokens and template; without a
    solver, the recorded conversations those tasks were made of (`recorded`, by task id: replay's accepted
    traces, which are its SFT targets), else the prompts with one turn of evaluate's max_new_tokens."""
    sample = random.Random(cfg.environment.seed).sample(train, min(SAMPLE_TASKS, len(train)))
    whole, passed, solver_s = None, [], None
    try:
        started = time.perf_counter()
        episodes = harness.run(OraclePolicy(harness.env), sample)
        solver_s = (time.perf_counter() - started) / len(sample)
        whole, passed = [e.messages for e in episodes], [e.passed for e in episodes]
        how = f"the solver's conversations on {len(sample)} train tasks"
    except NotImplementedError:
        pass
    if whole is None and recorded:
        sample = [t for t in sample if t.task_id in recorded] or sample
        if all(t.task_id in recorded for t in sample):
            whole, passed = [recorded[t.task_id] for t in sample], [True] * len(sample)
            how = f"the recorded conversations of {len(sample)} train tasks"
    tools = harness.env.tools()
    prompts = [t.prompt for t in sample]
    count = _Counter(cfg, root, prompts + (whole or []), tools)
    prompt_tokens = [count(p, prompt=True) for p in prompts]
    if whole is not None:
        lengths = [count(m) for m in whole]
        said = [[m for m in messages[len(t.prompt):] if m.get("role") == "assistant"]
                for t, messages in zip(sample, whole, strict=True)]
        turns = [max(1, len(each)) for each in said]
        # what the assistant wrote: its turns' text and calls, a few tokens of the template around each
        written = [count.text(m.get("content") or "") + 5
                   + count.text(json.dumps([c.get("function") for c in m.get("tool_calls") or []]))
                   for each in said for m in each]
        per_turn = sum(written) / max(len(written), 1)
    else:
        whole = prompts
        lengths = [p + EVAL_MAX_NEW_TOKENS for p in prompt_tokens]
        turns, per_turn, passed = [1] * len(sample), float(EVAL_MAX_NEW_TOKENS), [True]
        how = f"{len(sample)} train prompts with one turn of {EVAL_MAX_NEW_TOKENS} tokens (no scripted solver)"
    how += f", counted {count.how}"
    return Conversations(len(sample), lengths, sum(prompt_tokens) / len(sample), sum(turns) / len(turns),
                         per_turn, sum(passed) / len(passed), solver_s, how,
                         shared_opening([count.ids(m) for m in whole]))


def shared_opening(conversations: list[list[int]]) -> int:
    """The tokens every conversation starts with: SFT, the RL learner and the hf policy read them once a batch
    (flywheel/train/opening.py), so they cost once, not once a row. 0 for a single conversation."""
    if len(conversations) < 2:
        return 0
    first, n = conversations[0], min(len(c) for c in conversations)
    for i in range(n):
        if any(c[i] != first[i] for c in conversations[1:]):
            return i
    return n - 1  # (one is all opening: its last token is still read)


class _Counter:
    """Tokens of a conversation in the student's template: its own tokenizer, or for the tiny student (whose
    tokenizer SFT trains) one trained the same way on these conversations."""

    def __init__(self, cfg: PipelineConfig, root: Path, texts: list[list[dict]], tools: list[dict]):
        self.tools = tools
        if cfg.student.model == "tiny":
            from flywheel.train.tiny import render_conversation, train_tokenizer

            tiny = cfg.student.tiny
            rendered = [render_conversation(m, tools) for m in texts]
            self.tokenizer = train_tokenizer(rendered, tiny.vocab_size, tiny.isolate_spaces)
            self.render = lambda messages, prompt: render_conversation(messages, tools, add_generation_prompt=prompt)
            self.how = "with a tokenizer trained as SFT trains the tiny student's"
        else:
            from flywheel.policies.toolcalls import canonical_messages
            from flywheel.train.context import _tokenizer
            from flywheel.train.templates import training_template

            self.tokenizer, model_type = _tokenizer(cfg.student.model, root)
            configured = root / cfg.student.chat_template if cfg.student.chat_template else None
            template = training_template(self.tokenizer, cfg.student.model, model_type, configured=configured)
            self.render = lambda messages, prompt: self.tokenizer.apply_chat_template(
                canonical_messages(messages), tools=tools or None, chat_template=template,
                add_generation_prompt=prompt, tokenize=False)
            self.how = f"in {cfg.student.model}'s tokens and training template"

    def text(self, text: str) -> int:
        """Tokens of plain text."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def ids(self, messages: list[dict], prompt: bool = False) -> list[int]:
        return self.tokenizer(self.render(messages, prompt), add_special_tokens=False)["input_ids"]

    def __call__(self, messages: list[dict], prompt: bool = False) -> int:
        return len(self.ids(messages, prompt))


def padded_length(lengths: list[int], batch: int, cap: int, grouped_from: int = 0, seed: int = 0) -> float:
    """The expected longest row of a batch of `batch` examples, each cut to `cap`: a padded batch's width. Random
    batches: drawn. Batches grouped by length out of `grouped_from` examples (sft.group_by_length): the sampler
    sorts a random set of up to 50 batches' worth and cuts it, so a batch holds neighbours in length, a share
    batch / set of the lengths: the width is the longest of that many neighbours among `lengths`."""
    capped = [min(length, cap) for length in lengths]
    if grouped_from:
        together = min(grouped_from, batch * max(1, min(grouped_from // (batch * 4), 50)))
        near = max(1, min(len(capped), math.ceil(len(capped) * batch / together)))
        ordered = sorted(capped)
        return sum(max(ordered[i:i + near]) for i in range(len(ordered) - near + 1)) / (len(ordered) - near + 1)
    rng = random.Random(seed)
    return sum(max(rng.choices(capped, k=batch)) for _ in range(PADDING_DRAWS)) / PADDING_DRAWS


def sft_split(cfg: PipelineConfig, examples: int) -> tuple[int, int, int]:
    """SFT's `examples` conversations as (validation slice, eval loss slice, trained on)."""
    sft = cfg.sft
    validating = (int(sft.validation_tasks) if sft.validation_tasks >= 1
                  else round(sft.validation_tasks * examples)) if sft.validation_tasks else 0
    validating = max(0, min(validating, examples - 1))
    held = round((examples - validating) * sft.eval_fraction)
    return validating, held, examples - validating - held


def sft_width(cfg: PipelineConfig, convs: Conversations, trained: int) -> float:
    """SFT's padded width of a forward pass (a micro-batch: sft.micro_batch_tokens) over the sampled
    conversations, as its batches are drawn."""
    sft = cfg.sft
    return padded_length(convs.lengths, sft.micro_batch_size(), sft.max_length,
                         trained if sft.group_by_length else 0)


def generation_s(rows: int, turns: float, tokens_per_turn: float, read_tokens: float, batch: int,
                 speed: Speed, opening: float = 0.0) -> float:
    """Seconds to run `rows` episodes of `turns` turns in batches of `batch`: the decode steps of every turn, and
    reading what the episode did not write once (its prompt, tool results, user turns: a conversation's next turn
    reads only what is new, its cache kept; the shared `opening` once a batch)."""
    batches, width = math.ceil(rows / batch), min(rows, batch)
    read = batches * opening + rows * (read_tokens - opening)
    # each turn's new tokens are read in one pass a batch
    return (turns * batches * tokens_per_turn * speed.decode_s(width)
            + speed.forward_time(read, math.ceil(turns) * batches))


def _sft(cfg: PipelineConfig, convs: Conversations, examples: int, speed: Speed) -> tuple[float, str]:
    from flywheel.train.sft_validation import validation_steps

    sft = cfg.sft
    # the validation slice's tasks are left out of SFT's data and answered greedily at each validation point
    validating, held, trained = sft_split(cfg, examples)
    steps = cfg.sft.planned_steps(trained)
    width = sft_width(cfg, convs, trained)
    opening = min(convs.opening, width)
    micro = sft.micro_batch_size()
    passes = sft.batch_size // micro  # a step's micro-batches, each reading the shared opening once
    step = passes * (opening + micro * (width - opening))
    train = speed.train_time(steps * step, steps * passes)
    evals = (steps // sft.eval_every + 1) * speed.forward_time(held * width, math.ceil(held / micro))
    points = len(validation_steps(sft, trained, steps)) if validating else 0
    checks = points * generation_s(validating, convs.turns, convs.tokens_per_turn, convs.read_tokens,
                                   GENERATION_BATCH, speed, convs.opening)
    return speed.load_s + train + evals + checks, (
        f"{steps} steps (sft.planned_steps({trained})) x batch {sft.batch_size} x {width:.0f} padded tokens"
        + (f" (in {passes} passes of {micro}: sft.micro_batch_tokens)" if passes > 1 else "")
        + f" at {speed.train_time(step, passes):.1f} s a step"
        + (f", {points} validation point(s) of {validating} tasks" if points else ""))


def _rl(cfg: PipelineConfig, convs: Conversations, speed: Speed, train: int) -> tuple[float, str]:
    rl = cfg.rl
    if rl.steps == 0:
        return 0.0, "rl.steps 0"
    rows = rl.tasks_per_step * rl.group_size
    per_turn = min(convs.tokens_per_turn, rl.max_new_tokens)
    generate = generation_s(rows, convs.turns, per_turn, convs.read_tokens, GENERATION_BATCH, speed, convs.opening)
    length = sum(min(n, rl.max_length) for n in convs.lengths) / len(convs.lengths)
    forwards = 1 + (rl.kl_beta > 0)  # the old logprobs, and the reference's
    minibatches = math.ceil(rows / rl.minibatch_size)
    read = minibatches * convs.opening + rows * max(length - convs.opening, 0)
    learn = (speed.train_time(rl.epochs_per_batch * read, rl.epochs_per_batch * minibatches)
             + forwards * speed.forward_time(read, minibatches))
    checks = 0.0
    if rl.keep_best:  # versions 0, every validate_every-th and the last, on at most half the train tasks
        points = len({0, *range(rl.validate_every, rl.steps + 1, rl.validate_every), rl.steps})
        checks += points * generation_s(min(rl.validate_tasks, train // 2), convs.turns, convs.tokens_per_turn,
                                        convs.read_tokens, GENERATION_BATCH, speed, convs.opening)
    if rl.monitor_every:
        checks += (rl.steps // rl.monitor_every + 1) * generation_s(
            rl.monitor_tasks, convs.turns, convs.tokens_per_turn, convs.read_tokens, GENERATION_BATCH, speed,
            convs.opening)
    total = speed.load_s + rl.steps * (generate + learn) + checks
    return total, (f"{rl.steps} steps x {rows} episodes ({rl.tasks_per_step} tasks x {rl.group_size}), "
                   f"{per_turn:.0f} tokens a turn, {rl.epochs_per_batch} epoch(s) over {length:.0f} tokens each")


def _evaluate(cfg: PipelineConfig, convs: Conversations, heldout: int, speed: Speed) -> tuple[float, str]:
    ev = cfg.evaluate
    rows = heldout * (1 + ev.samples)
    trained = generation_s(rows, convs.turns, min(convs.tokens_per_turn, EVAL_MAX_NEW_TOKENS), convs.read_tokens,
                           ev.batch_size, speed, convs.opening)
    # the base student has learned nothing of the task yet: it may write every turn to the limit
    base = generation_s(rows, convs.turns, EVAL_MAX_NEW_TOKENS, convs.read_tokens, ev.batch_size, speed,
                        convs.opening)
    models = 2 if cfg.rl.steps else 1  # sft and rl (rl is sft when it takes no step)
    return 3 * speed.load_s + base + models * trained, (
        f"{heldout} held-out tasks x {1 + ev.samples} episode(s) for base, sft{', rl' if cfg.rl.steps else ''} "
        f"(null: no model); base at {EVAL_MAX_NEW_TOKENS} tokens a turn")


def clock(seconds: float | None) -> str:
    """Seconds as m:ss or h:mm:ss ('?' when not estimated)."""
    if seconds is None:
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def render(est: Estimate) -> list[str]:
    """The estimate as `flywheel check` prints it: the speed and tasks it used, then one line a stage."""
    sp, convs = est.speed, est.conversations
    lines = []
    if sp is not None:
        rows, width = est.sft_shape or (1, 64)
        tokens = rows * width
        lines += [f"    student {sp.student} on this machine ({sp.machine}, {sp.threads} threads), "
                  f"{'kept in .flywheel/probe/' if sp.cached else 'measured now'}: a training step of {rows} x "
                  f"{width:.0f} tokens {sp.train_step_s(tokens):.2f} s ({sp.train_fixed_s:.2f} s a step + "
                  f"{sp.train_token_s * 1000:.2f} ms a token), a forward pass of it "
                  f"{sp.forward_time(tokens):.2f} s, a decode step " + ", ".join(
                      f"{t * 1000:.1f} ms at batch {b}" for b, t in sorted(sp.decode_step_s.items()))
                  + f", loading {sp.load_s:.1f} s"]
    if convs is not None:
        lines.append(f"    conversations: {convs.how}: {sum(convs.lengths) / convs.sampled:.0f} tokens (longest "
                     f"{max(convs.lengths)}; {convs.opening} shared by all, read once a batch), prompt "
                     f"{convs.prompt_tokens:.0f}, {convs.turns:.1f} assistant turn(s) "
                     f"of {convs.tokens_per_turn:.0f} tokens")
    lines.append(f"    {'stage':<11} {'estimate':>9}  from")
    for stage in STAGES:
        lines.append(f"    {stage:<11} {clock(est.seconds[stage]):>9}  {est.inputs[stage]}")
    lines.append(f"    {'total':<11} {clock(est.total):>9}{'' if est.complete else '  (stages marked ? not counted)'}")
    lines += [f"    note: {note}" for note in est.notes]
    return lines
