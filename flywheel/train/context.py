"""Whether an environment's prompts fit the student's context: `flywheel check` and `flywheel run` ask before any
stage trains, since a prompt the context cannot hold fails, or trains on cut conversations, hours later.

Three lengths. The student's context: the tiny student's `student.tiny.max_position_embeddings`, a checkpoint's
config.json `max_position_embeddings`, a GGUF file's `<arch>.context_length` (read from its header, not by
loading the model). The prompt: the longest first turn (a task's messages and the environment's tools) over the
environment's first tasks, rendered with the template the student trains on and counted with its tokenizer. The
budget: the tokens one turn may generate, rl.max_new_tokens and the evaluation's EVAL_MAX_NEW_TOKENS.

The tiny student's tokenizer is trained in SFT, so its count is not known before: the prompt's UTF-8 bytes bound
it (a byte-level BPE token is a byte or more), and where that bound does not fit, a tokenizer trained as SFT
trains it (same vocabulary size and options), on these prompts, gives the estimate that decides.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from flywheel.checkpoints import (
    ADAPTER_CONFIG,
    CheckpointError,
    adapter_base,
    file_md5,
    gguf_cache_dir,
    gguf_file,
    is_gguf,
)
from flywheel.config import PipelineConfig
from flywheel.contract import Environment, Task
from flywheel.errors import UserFacingError
from flywheel.policies.base import Sampling
from flywheel.policies.toolcalls import canonical_messages
from flywheel.train.students import first_tasks, tiny_prompt
from flywheel.train.templates import training_template

# What evaluate generates per turn (flywheel/evaluate/runner.py samples with Sampling's default), as do RL's
# monitor and validation: not a key of pipelines.yaml.
EVAL_MAX_NEW_TOKENS = Sampling().max_new_tokens


class ContextError(UserFacingError, ValueError):
    """The prompt and a turn's tokens, or a max_length, do not fit the student's context; the message names the
    lengths and the keys to change."""


@dataclass(frozen=True)
class Context:
    """A student's context in tokens and where the number comes from: the pipeline's key that sets it (the tiny
    student's), else the file it was read from."""

    tokens: int
    key: str | None = None
    source: str = ""

    def said(self, keys: str) -> str:
        return f"the student's context of {self.tokens} tokens ({f'{keys}.{self.key}' if self.key else self.source})"

    def longer(self, keys: str, needed: int) -> str:
        """How to get a context of `needed` tokens."""
        if self.key:
            return f"raise {keys}.{self.key} to at least {needed}"
        return f"set {keys}.student.model to a student with a context of at least {needed}"


@dataclass(frozen=True)
class PromptLength:
    """The longest first-turn prompt in tokens, and how it was counted (said in the message)."""

    tokens: int
    counted: str


def check_fit(pipeline: str, cfg: PipelineConfig, env: Environment, root: Path) -> list[str]:
    """Raise ContextError naming every way the pipeline's prompts, budget and max_lengths exceed its student's
    context (cfg with `auto` resolved); return notes on what could not be checked."""
    try:
        context = student_context(cfg, root)
    except (OSError, ValueError) as err:  # CheckpointError: a GGUF package or a folder not there yet
        return [f"the student's context is unknown, so the prompt's fit was not checked: {err}"]
    if context is None:
        return ["the student's config names no max_position_embeddings, so the prompt's fit was not checked"]
    keys = f"pipelines.{pipeline}"
    tasks = first_tasks(env, cfg.environment.seed) + longest_collected(env)
    problems = _max_lengths(keys, cfg, context)
    if not tasks:  # an environment whose tasks come from traces: nothing to render before collect
        _raise(problems)
        return []
    tools = env.tools()
    if cfg.student.model == "tiny":
        texts = [tiny_prompt(t, tools) for t in tasks]
        bound = max(len(text.encode()) for text in texts)
        if not _prompt_problems(keys, cfg, PromptLength(bound, ""), context):
            _raise(problems)
            return []
        prompt = PromptLength(_tiny_estimate(texts, cfg), f"(estimated with a tokenizer trained as SFT trains the "
                              f"tiny student's; at most {bound}: its UTF-8 bytes, a byte-level BPE token being a "
                              "byte or more)")
    else:
        try:
            prompt = _counted(cfg, tasks, tools, root)
        except (OSError, ValueError) as err:  # CheckpointError, ChatTemplateError: the sft stage says them
            _raise(problems)
            return [f"the prompt could not be counted with the student's tokenizer, so its fit was not checked: "
                    f"{err}"]
    _raise(problems + _prompt_problems(keys, cfg, prompt, context))
    return []


def longest_collected(env: Environment, count: int = 8) -> list[Task]:
    """The collected tasks (replay's, from the tasks table) with the longest prompts; none before collect."""
    recorded = getattr(env, "recorded_tasks", None)
    tasks = recorded() if recorded is not None else []
    return sorted(tasks, key=lambda t: len(json.dumps(t.prompt, ensure_ascii=False)), reverse=True)[:count]


def _raise(problems: list[str]) -> None:
    if problems:
        raise ContextError("\n".join(problems))


def _max_lengths(keys: str, cfg: PipelineConfig, context: Context) -> list[str]:
    """A max_length over the context: positions the student never had would be trained on."""
    return [f"{keys}.{key} {length} is over {context.said(keys)}: lower {keys}.{key} to {context.tokens} or "
            f"less, or {context.longer(keys, length)}" for key, length in _max_length_keys(cfg)
            if length > context.tokens]


def _max_length_keys(cfg: PipelineConfig) -> list[tuple[str, int]]:
    """The lengths training cuts conversations to: SFT's, and RL's when RL runs."""
    return [("sft.max_length", cfg.sft.max_length)] + ([("rl.max_length", cfg.rl.max_length)] if cfg.rl.steps
                                                       else [])


def _prompt_problems(keys: str, cfg: PipelineConfig, prompt: PromptLength, context: Context) -> list[str]:
    """The prompt and one turn's tokens over the context; a prompt that leaves a max_length no room for an answer."""
    said = f"the environment's longest first-turn prompt is {prompt.tokens} tokens" + \
        (f" {prompt.counted}" if prompt.counted else "")
    rl_budget = cfg.rl.max_new_tokens if cfg.rl.steps else 0
    budget = max(rl_budget, EVAL_MAX_NEW_TOKENS)
    problems = []
    if prompt.tokens + budget > context.tokens:
        lower = f", lower {keys}.rl.max_new_tokens" if rl_budget == budget else ""
        why = f"rl.max_new_tokens {rl_budget}" if rl_budget == budget else \
            f"evaluate generates up to {EVAL_MAX_NEW_TOKENS} a turn"
        problems.append(f"{said}, and a turn generates up to {budget} more ({why}): {prompt.tokens + budget} "
                        f"tokens, over {context.said(keys)}: {context.longer(keys, prompt.tokens + budget)}"
                        f"{lower}, or shorten the prompt")
    for key, length in _max_length_keys(cfg):
        if prompt.tokens >= length:
            problems.append(f"{said}, and {key} {length} leaves no room for an answer after it (a conversation cut "
                            f"there keeps no assistant token): raise {keys}.{key} above {prompt.tokens} "
                            f"(the student's context is {context.tokens})")
    return problems


def student_context(cfg: PipelineConfig, root: Path) -> Context | None:
    """The student's context: the tiny config's, a GGUF header's, or a checkpoint's config.json (None: it says none)."""
    model = cfg.student.model
    if model == "tiny":
        return Context(cfg.student.tiny.max_position_embeddings, key="student.tiny.max_position_embeddings")
    return _named_context(model, root)


def _named_context(model: str, root: Path) -> Context | None:
    if is_gguf(model):
        field, tokens = gguf_context_length(gguf_file(model, root))
        return Context(tokens, source=f"{model}: its GGUF header's {field}")
    folder = _local(model, root)
    if folder is not None and (folder / ADAPTER_CONFIG).exists():
        return _named_context(adapter_base(folder), root)
    if folder is not None:
        config = json.loads((folder / "config.json").read_text())
    else:  # a hub id, from the local cache
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=False).to_dict()
    tokens = config.get("max_position_embeddings") or config.get("n_positions")
    return Context(int(tokens), source=f"{model}: its config.json") if tokens else None


def _local(model: str, root: Path) -> Path | None:
    """The checkpoint folder a student names, under the root or as given; None for a hub id."""
    for folder in (root / model, Path(model)):
        if folder.is_dir():
            return folder
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return None
    raise CheckpointError(f"{model}: no such checkpoint folder")


def gguf_context_length(file: Path) -> tuple[str, int]:
    """(`<arch>.context_length`, its value) from a GGUF file's header, without reading its weights. Parsing the
    header takes seconds (every tensor's entry is read), so the answer is kept in the GGUF cache, keyed by the
    file's name, size and modification time: `flywheel check` and every run read it once a file."""
    stat = file.stat()
    kept = gguf_cache_dir() / "context" / f"{file.name}-{stat.st_size}-{stat.st_mtime_ns}.json"
    try:
        field, tokens = json.loads(kept.read_text())
        return str(field), int(tokens)
    except (OSError, ValueError, TypeError):
        pass  # not kept yet (or damaged): parsed again
    from gguf import GGUFReader

    reader = GGUFReader(file)
    arch = reader.fields["general.architecture"].contents()
    field = f"{arch}.context_length"
    if field not in reader.fields:
        raise CheckpointError(f"{file}: its GGUF header has no {field}")
    tokens = int(reader.fields[field].contents())
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps([field, tokens]))
        partial.replace(kept)
    except OSError:
        pass  # a cache that cannot be written costs the next check its parse
    return field, tokens


def _tiny_estimate(texts: list[str], cfg: PipelineConfig) -> int:
    """The rendered prompts' tokens under a tokenizer trained on them as SFT trains the tiny student's."""
    from flywheel.train.tiny import train_tokenizer

    tiny = cfg.student.tiny
    tokenizer = train_tokenizer(texts, tiny.vocab_size, tiny.isolate_spaces)
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def _counted(cfg: PipelineConfig, tasks: list[Task], tools: list[dict], root: Path) -> PromptLength:
    """The longest prompt in the student's own tokens, rendered with the template SFT will train it on."""
    tokenizer, model_type = _tokenizer(cfg.student.model, root)
    configured = root / cfg.student.chat_template if cfg.student.chat_template else None
    template = training_template(tokenizer, cfg.student.model, model_type, configured=configured)
    longest = max(len(tokenizer.apply_chat_template(canonical_messages(t.prompt), tools=tools or None,
                                                    chat_template=template, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]) for t in tasks)
    return PromptLength(longest, "")


def _tokenizer(model: str, root: Path):
    """(tokenizer, config.json's model_type) of a named student: a GGUF file's (its de-quantised copy's when the
    GGUF cache has one: no parsing), an adapter's or checkpoint folder's, or a cached hub id's."""
    from transformers import AutoConfig, AutoTokenizer

    if is_gguf(model):
        file = gguf_file(model, root)
        cached = gguf_cache_dir() / file_md5(file)
        if (cached / "config.json").is_file():
            model_type = json.loads((cached / "config.json").read_text()).get("model_type")
            return AutoTokenizer.from_pretrained(str(cached)), model_type
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name), None
    folder = _local(model, root)
    source = str(folder) if folder is not None else model
    if folder is not None and (folder / ADAPTER_CONFIG).exists():
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False), None
    model_type = getattr(AutoConfig.from_pretrained(source, trust_remote_code=False), "model_type", None)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=False), model_type
