"""pipelines.yaml validation: every bad key or value is an error naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flywheel.config import ConfigError, load_pipeline, load_pipelines

REPO = Path(__file__).resolve().parent.parent


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "pipelines.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _demo() -> dict:
    return yaml.safe_load((REPO / "pipelines.yaml").read_text())


def test_the_shipped_file_is_valid():
    pipelines = load_pipelines(REPO / "pipelines.yaml")
    assert pipelines["demo"].student.model == "tiny"
    assert pipelines["demo"].schedule.cron


def test_misspelt_key_names_the_file_and_the_key(tmp_path):
    data = _demo()
    data["pipelines"]["demo"]["sft"]["learning_rate"] = 0.1
    with pytest.raises(ConfigError) as err:
        load_pipelines(_write(tmp_path, data))
    assert "pipelines.yaml" in str(err.value)
    assert "unknown key 'pipelines.demo.sft.learning_rate'" in str(err.value)


def test_bad_value_names_the_key_and_the_value(tmp_path):
    data = _demo()
    data["pipelines"]["demo"]["rl"]["group_size"] = 0
    data["pipelines"]["demo"]["sft"]["lr"] = "fast"
    with pytest.raises(ConfigError) as err:
        load_pipelines(_write(tmp_path, data))
    message = str(err.value)
    assert "pipelines.demo.rl.group_size" in message and "(got 0)" in message
    assert "pipelines.demo.sft.lr" in message and "'fast'" in message


def test_missing_section_says_how_to_take_the_defaults(tmp_path):
    data = _demo()
    del data["pipelines"]["demo"]["evaluate"]
    with pytest.raises(ConfigError, match=r"missing key 'pipelines.demo.evaluate' \(write `\{\}`"):
        load_pipelines(_write(tmp_path, data))


def test_cross_field_rule_is_reported(tmp_path):
    data = _demo()
    data["pipelines"]["demo"]["student"]["tiny"]["heads"] = 3
    with pytest.raises(ConfigError, match="not divisible by heads 3"):
        load_pipelines(_write(tmp_path, data))


@pytest.mark.parametrize("text, expected", [
    ("pipelines: [unclosed", "not valid YAML"),
    ("just_a_string", "top-level 'pipelines:' mapping"),
    ("other: {}", "top-level 'pipelines:' mapping"),
])
def test_unreadable_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_pipelines(_write(tmp_path, text))


def test_missing_file_and_unknown_pipeline(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_pipelines(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"no pipeline named 'prod' \(have: demo, replay, rl-lift, smol, support, "
                                          r"support-smol\)"):
        load_pipeline("prod", _write(tmp_path, _demo()))


def test_section_hash_changes_only_with_its_sections(tmp_path):
    base = load_pipeline("demo", REPO / "pipelines.yaml")
    data = _demo()
    data["pipelines"]["demo"]["rl"]["lr"] = 1e-3
    changed = load_pipeline("demo", _write(tmp_path, data))
    assert base.section_hash("sft") == changed.section_hash("sft")
    assert base.section_hash("rl") != changed.section_hash("rl")


def test_cli_check_prints_the_errors(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app

    data = _demo()
    data["pipelines"]["demo"]["gate"]["min_scor"] = 0.5
    _write(tmp_path, data)
    result = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown key 'pipelines.demo.gate.min_scor'" in result.output


def test_cli_check_fails_while_dvc_yaml_is_out_of_date(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app
    from tasks.spec import dvc_yaml

    data = _demo()
    _write(tmp_path, data)
    (tmp_path / "dvc.yaml").write_text(dvc_yaml(tmp_path))
    assert CliRunner().invoke(app, ["check", "--root", str(tmp_path)]).exit_code == 0
    data["pipelines"]["demo"]["collect"]["sources"] = ["logs/agent/*.jsonl"]  # collect@demo now reads logs/agent
    _write(tmp_path, data)
    result = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert "dvc.yaml is out of date" in result.output and "python -m tasks.spec > dvc.yaml" in result.output


def test_cli_check_names_a_missing_opd_teacher(tmp_path):
    """On-policy distillation's local teacher is checked before any stage runs (the rl stage is hours later)."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    data = _demo()
    data["pipelines"] = {"demo": data["pipelines"]["demo"]}
    data["pipelines"]["demo"]["rl"] |= {"objective": "opd", "opd": {"teacher": "models/teacher"}}
    _write(tmp_path, data)
    result = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert "pipelines.demo.rl.opd.teacher" in result.output and "models/teacher: no such checkpoint folder" \
        in result.output


PASTED = "sk-proj-Pasted0Key1Never2Echoed3"


@pytest.mark.parametrize("section, key", [
    ("teacher", "teacher.api_key_env"),
    ("user", "environment.user.api_key_env"),
    ("judge", "environment.replay.judge.api_key_env"),
    ("reference", "evaluate.references.0.api_key_env"),
    ("opd", "rl.opd.api_key_env"),
])
def test_a_key_pasted_into_any_endpoint_section_is_named_but_never_echoed(tmp_path, section, key):
    data = _demo()
    demo = data["pipelines"]["demo"]
    endpoint = {"model": "m", "api_key_env": PASTED}
    if section == "teacher":
        demo["teacher"] = {"policy": "openai", **endpoint}
    elif section == "user":
        demo["environment"]["user"] = {"kind": "openai", **endpoint}
    elif section == "judge":
        demo["environment"]["replay"] = {"judge": endpoint}
    elif section == "reference":
        demo["evaluate"]["references"] = [{"name": "ref", **endpoint}]
    else:
        demo["rl"] |= {"objective": "opd", "opd": {"teacher": "m", "base_url": "http://localhost:8000/v1",
                                                  "api_key_env": PASTED}}
    with pytest.raises(ConfigError) as err:
        load_pipelines(_write(tmp_path, data))
    message = str(err.value)
    assert f"pipelines.demo.{key}" in message and "never the key itself" in message
    assert PASTED not in message and "Pasted0Key" not in message


def test_rl_opd_beside_the_reward_objective_is_an_error_not_a_section_nobody_reads(tmp_path):
    data = _demo()
    data["pipelines"]["demo"]["rl"] |= {"objective": "reward", "opd": {"teacher": "models/t"}}
    with pytest.raises(ConfigError, match=r"pipelines\.demo\.rl: rl\.opd is set, but objective 'reward' has no "
                                          r"teacher"):
        load_pipelines(_write(tmp_path, data))


def test_a_bad_rl_opd_value_is_named_where_it_is_written(tmp_path):
    """RLConfig keeps rl.opd inside the objective's variant; the error names it as pipelines.yaml has it."""
    data = _demo()
    data["pipelines"]["demo"]["rl"] |= {"objective": "reward+opd", "opd": {"teacher": "models/t", "kl_coef": 0}}
    with pytest.raises(ConfigError, match=r"pipelines\.demo\.rl\.opd\.kl_coef: Input should be greater than 0"):
        load_pipelines(_write(tmp_path, data))
