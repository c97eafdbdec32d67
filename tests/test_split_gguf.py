"""A GGUF file shipped in several packages (`parts:FILE`): joined once into the GGUF cache, checked against its
recorded size and sha256, and every way it can be missing named with its fix; (slow, where `make qwen-setup` has
run) the real bigger student, Qwen2.5-Coder-0.5B-Instruct, loaded from its six packages and one LoRA step of
the sft stage on it."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil

import pytest

from flywheel.checkpoints import GGUF_CACHE_ENV, SPLIT_GGUF, CheckpointError, SplitGGUF, gguf_file, is_gguf
from flywheel.train.students import QWEN_CODER_05B, STUDENT_NAMES, StudentChoice


def ship_parts(site, chunks: list[bytes]) -> tuple[tuple[str, str], ...]:
    """One importable package a chunk under site/, as the bigger student's parts are shipped: (package, file)."""
    parts = []
    for i, chunk in enumerate(chunks, 1):
        package = site / f"flywheel_test_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i}.bin").write_bytes(chunk)
        parts.append((package.name, f"data/part{i}.bin"))
    return tuple(parts)


@pytest.fixture
def split(tmp_path, monkeypatch):
    """A three-part file registered as parts:test.gguf, its packages on sys.path, the GGUF cache in tmp_path."""
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"\x00middle" * 50, b"the end"]
    whole = b"".join(chunks)
    site = tmp_path / "site"
    parts = ship_parts(site, chunks)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv(GGUF_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(SPLIT_GGUF, "test.gguf", SplitGGUF(parts=parts, size=len(whole),
                                                           sha256=hashlib.sha256(whole).hexdigest(),
                                                           setup="run `make test-parts`"))
    return whole, site, tmp_path / "cache"


def test_the_parts_are_joined_once_into_the_cache_and_read_from_there_after(split):
    whole, site, cache = split
    assert is_gguf("parts:test.gguf")
    file = gguf_file("parts:test.gguf")
    assert file == cache / "joined" / "test.gguf" and file.read_bytes() == whole
    assert [p.name for p in file.parent.iterdir()] == ["test.gguf"]  # no partial file left beside it
    (site / "flywheel_test_part2" / "data" / "part2.bin").unlink()  # the joined copy no longer needs the parts
    assert gguf_file("parts:test.gguf").read_bytes() == whole


def test_parts_that_are_not_the_pinned_bytes_are_refused_and_nothing_is_kept(split):
    _, site, cache = split
    (site / "flywheel_test_part3" / "data" / "part3.bin").write_bytes(b"the END")  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"parts:test\.gguf: the joined parts are \d+ bytes with sha256 "
                                              r"[0-9a-f]{64}, not .*not the pinned versions \(run `make test-parts`\)"):
        gguf_file("parts:test.gguf")
    assert list((cache / "joined").iterdir()) == []


def test_a_missing_package_or_part_and_an_unknown_name_say_what_to_do(split):
    _, site, _ = split
    (site / "flywheel_test_part2" / "data" / "part2.bin").unlink()
    with pytest.raises(CheckpointError, match=r"the part .*part2\.bin is missing from its package; reinstall it: "
                                              r"run `make test-parts`"):
        gguf_file("parts:test.gguf")
    shutil.rmtree(site / "flywheel_test_part2")
    importlib.invalidate_caches()
    with pytest.raises(CheckpointError, match=r"parts:test\.gguf: the package 'flywheel_test_part2' that ships this "
                                              r"file is not installed; run `make test-parts`"):
        gguf_file("parts:test.gguf")
    with pytest.raises(CheckpointError, match=r"parts:other\.gguf: no GGUF file of that name .*known: .*"
                                              r"parts:Qwen2\.5-Coder-0\.5B-Instruct\.Q4_K_M\.gguf"):
        gguf_file("parts:other.gguf")


def test_the_bigger_student_is_named_in_a_runs_summary():
    assert StudentChoice(QWEN_CODER_05B).line() == "Qwen2.5-Coder-0.5B-Instruct (named by student.model)"
    assert STUDENT_NAMES[QWEN_CODER_05B] == "Qwen2.5-Coder-0.5B-Instruct"
    assert QWEN_CODER_05B.removeprefix("parts:") in SPLIT_GGUF


QWEN_INSTALLED = all(importlib.util.find_spec(package) is not None
                     for package, _ in SPLIT_GGUF["Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"].parts)


@pytest.mark.slow
@pytest.mark.skipif(not QWEN_INSTALLED or importlib.util.find_spec("gguf") is None,
                    reason="the bigger student is opt-in: `make qwen-setup` (491 MB) has not run here")
def test_qwen_coder_loads_from_its_parts_with_a_tool_template_it_can_train_on(tmp_path):
    import torch
    from family_students import calculator_rows

    from flywheel.checkpoints import load_student
    from flywheel.config import LoRAConfig, SFTConfig
    from flywheel.train.sft import train_sft
    from flywheel.train.templates import has_generation_markers, training_template

    model, tokenizer = load_student(QWEN_CODER_05B)
    assert type(model).__name__ == "Qwen2ForCausalLM" and {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == 630_167_424  # 494M and an untied output matrix
    tools = [{"type": "function", "function": {"name": "lookup_order", "description": "Look up an order",
                                               "parameters": {"type": "object",
                                                              "properties": {"order_id": {"type": "string"}}}}}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Where is order A1?"}], tools=tools,
                                             tokenize=False, add_generation_prompt=True)
    assert '"name": "lookup_order"' in rendered and "<tool_call>" in rendered
    assert has_generation_markers(training_template(tokenizer, QWEN_CODER_05B))  # TRL's Qwen2.5 variant
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in "
                                                                     "one word."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    del model

    # one LoRA step of the sft stage on its own template (the adapter saved, not a merged 2.5 GB copy)
    cfg = SFTConfig(steps=1, batch_size=2, lr=1e-3, warmup_steps=0, max_length=512, eval_fraction=0.0, log_every=1,
                    lora=LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"], save="adapter"))
    result = train_sft(QWEN_CODER_05B, calculator_rows(4), tmp_path / "sft", cfg, device="cpu")
    assert result["steps"] == 1 and result["tokens"] > 0 and (tmp_path / "sft" / "adapter_config.json").is_file()
