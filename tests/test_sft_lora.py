"""LoRA through peft: train, merge for registration or keep the adapter naming its base; both load back."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from family_students import calculator_rows

from flywheel.checkpoints import adapter_base, load_student
from flywheel.config import LoRAConfig, SFTConfig
from flywheel.train.sft import train_sft


def lora_cfg(save: str, quantize: str | None = None) -> SFTConfig:
    return SFTConfig(steps=6, batch_size=8, lr=5e-3, warmup_steps=1, max_length=128, eval_fraction=0.0,
                     log_every=1, lora=LoRAConfig(r=4, alpha=8, save=save, quantize=quantize))


@pytest.fixture(scope="module")
def rows():
    return calculator_rows(32)


def test_lora_merged_is_a_plain_checkpoint_that_learned(tiny_student, rows, tmp_path):
    base, _ = load_student(tiny_student)
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", lora_cfg("merged"))
    assert metrics["steps"] == 6
    assert not (tmp_path / "sft" / "adapter_config.json").exists()
    model, tokenizer = load_student(tmp_path / "sft")
    assert type(model).__name__ == type(base).__name__  # merged: no peft wrapper left
    tuned = dict(model.named_parameters())
    changed = [name for name, p in base.named_parameters() if not torch.equal(p, tuned[name])]
    # LoRA adapts the linear layers only: embeddings and norms stay the base's
    assert changed and all("proj" in name for name in changed)


def test_lora_adapter_loads_over_its_named_base_trainable(tiny_student, rows, tmp_path):
    train_sft(tiny_student, rows, tmp_path / "sft", lora_cfg("adapter"))
    folder = tmp_path / "sft"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_base(folder) == config["base_model_name_or_path"] == str(tiny_student)
    assert adapter_base(tiny_student) is None
    model, tokenizer = load_student(folder)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)  # RL trains the adapter, the base is frozen
    ids = tokenizer("<|im_start|>user\n2+2<|im_end|>\n", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert ids["input_ids"].shape[1] < out.shape[1] <= ids["input_ids"].shape[1] + 3  # eval generates through it
    # the adapter's merged weights equal what `merged` would have saved from the same run
    merged = model.merge_and_unload()
    again = train_sft(tiny_student, rows, tmp_path / "merged", lora_cfg("merged"))
    assert again["resumed_from"] is None
    reference = dict(load_student(tmp_path / "merged")[0].named_parameters())
    for name, p in merged.named_parameters():
        assert torch.allclose(p, reference[name], atol=1e-6), name


def test_qlora_on_cpu_is_a_clear_error(tiny_student, rows, tmp_path):
    # student.device cpu refuses on every machine; auto refuses where there is no GPU or no bitsandbytes
    with pytest.raises(RuntimeError, match="QLoRA\\) needs a CUDA GPU and the bitsandbytes"):
        train_sft(tiny_student, rows, tmp_path / "sft", lora_cfg("merged", quantize="4bit"), device="cpu")
    if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(RuntimeError, match="QLoRA\\) needs a CUDA GPU and the bitsandbytes"):
            train_sft(tiny_student, rows, tmp_path / "sft", lora_cfg("merged", quantize="4bit"))


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                    reason="QLoRA needs a CUDA GPU and bitsandbytes (the gpu extra); neither is here")
@pytest.mark.parametrize("quantize", ["4bit", "8bit"])
def test_qlora_trains_on_a_gpu_and_merges_into_a_full_precision_base(tiny_student, rows, tmp_path, quantize):
    base, _ = load_student(tiny_student)
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", lora_cfg("merged", quantize=quantize), device="cuda")
    assert metrics["steps"] == 6 and metrics["final_loss"] is not None
    assert not (tmp_path / "sft" / "adapter_config.json").exists()
    model, _ = load_student(tmp_path / "sft")
    assert type(model).__name__ == type(base).__name__  # merged: no peft wrapper, no quantised layers
    assert all(p.dtype == base.get_parameter(name).dtype for name, p in model.named_parameters())
    tuned = dict(model.named_parameters())
    changed = [name for name, p in base.named_parameters() if not torch.equal(p, tuned[name])]
    assert changed and all("proj" in name for name in changed)


def test_an_fsdp_save_merges_the_adapter_before_returning(tiny_student, rows, tmp_path, monkeypatch):
    """FSDP cannot run here: the trainer is told it is sharded and saves as the FSDP gather does on one process
    (the peft model writes its adapter); `merged` must still leave a plain checkpoint."""
    from flywheel.checkpoints import save_student
    from flywheel.train.sft import _save, build_sft_trainer

    cfg = lora_cfg("merged")
    trainer, _, _ = build_sft_trainer(tiny_student, rows, tmp_path / "sft", cfg, device="cpu")
    trainer.train()
    trainer.is_fsdp_enabled = True
    saved = []
    monkeypatch.setattr(trainer, "save_model",
                        lambda folder: saved.append(folder) or save_student(trainer.model, trainer.processing_class,
                                                                            folder))
    _save(trainer, tmp_path / "sft", tiny_student, cfg)
    assert saved and not (tmp_path / "sft" / "adapter_config.json").exists()
    model, _ = load_student(tmp_path / "sft")
    base, _ = load_student(tiny_student)
    assert type(model).__name__ == type(base).__name__
    merged = dict(model.named_parameters())
    assert any(not torch.equal(p, merged[name]) for name, p in base.named_parameters())
