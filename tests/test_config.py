"""pipelines.yaml validation: every bad key or value is an error naming the file and the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from flywheel.config import ConfigError, RLConfig, SFTConfig, load_pipeline, load_pipelines

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
    assert "pipelines.demo.sft.learning_rate: unknown key; did you mean 'lr'?" in str(err.value)


@pytest.mark.parametrize("section, key, expected", [
    (("student", "tiny"), "hiden_size", "pipelines.demo.student.tiny.hiden_size: unknown key; did you mean "
                                        "'hidden_size'?"),
    (("collect", "sources", 0), "paths", "pipelines.demo.collect.sources.0.paths: unknown key; did you mean 'path'?"),
    (("gate",), "min_scor", "pipelines.demo.gate.min_scor: unknown key; did you mean 'min_score'?"),
    (("schedule",), "crn", "pipelines.demo.schedule.crn: unknown key; did you mean 'cron'?"),
    (("rl", "opd"), "kl_coeff", "pipelines.demo.rl.opd.kl_coeff: unknown key; did you mean 'kl_coef'?"),
    (("rl",), "odp", "pipelines.demo.rl.odp: unknown key; did you mean 'opd'?"),
    (("sft",), "max_seq_length", "pipelines.demo.sft.max_seq_length: unknown key; did you mean 'max_length'?"),
    (("synthesize",), "zzz", "pipelines.demo.synthesize.zzz: unknown key; this section's keys are exclude_slices, "
                             "include_accepted_traces, keep_best_only, max_new_tokens, samples_per_task, temperature, "
                             "top_p"),
])
def test_an_unknown_key_names_the_nearest_valid_one(tmp_path, section, key, expected):
    """difflib over the section's own keys (and a few names other tools use: learning_rate for lr); where none is
    close, the section's keys."""
    data = _demo()
    demo = data["pipelines"]["demo"]
    if section[0] == "rl" and section[1:] == ("opd",):
        demo["rl"] |= {"objective": "reward+opd", "opd": {"teacher": "models/t"}}
    if section[0] == "collect":
        demo["collect"]["sources"] = [{"path": "examples/traces/*.jsonl"}]
    place = demo
    for part in section:
        place = place[part]
    place[key] = 1
    with pytest.raises(ConfigError) as err:
        load_pipelines(_write(tmp_path, data))
    assert str(err.value) == f"{tmp_path / 'pipelines.yaml'}: {expected}"


def test_bad_value_names_the_key_and_the_value(tmp_path):
    data = _demo()
    data["pipelines"]["demo"]["rl"]["group_size"] = 0
    data["pipelines"]["demo"]["sft"]["lr"] = "fast"
    with pytest.raises(ConfigError) as err:
        load_pipelines(_write(tmp_path, data))
    message = str(err.value)
    assert "pipelines.demo.rl.group_size" in message and "(got 0)" in message
    assert "pipelines.demo.sft.lr" in message and "'fast'" in message


def test_missing_environment_says_how_to_take_the_defaults(tmp_path):
    data = _demo()
    del data["pipelines"]["demo"]["environment"]
    with pytest.raises(ConfigError, match=r"missing key 'pipelines.demo.environment' \(write `\{\}`"):
        load_pipelines(_write(tmp_path, data))


def test_a_pipeline_of_only_its_environment_validates_and_takes_its_students_profile(tmp_path):
    from flywheel.train.students import SMOLLM2, resolve_student

    path = _write(tmp_path, {"pipelines": {"mine": {"environment": {"name": "support"}},
                                           "demo": {"environment": {"name": "calculator"}}}})
    mine = load_pipelines(path)["mine"]
    assert mine.teacher.policy == "oracle" and mine.collect.sources == [] and mine.student.model == "auto"
    resolved, choice = resolve_student(mine, tmp_path)  # reads the config only: SmolLM2 is not loaded
    assert choice.model == resolved.student.model == SMOLLM2
    assert resolved.sft.steps is None and resolved.sft.epochs == 3.0 and resolved.sft.validation_tasks == 0.1
    assert resolved.sft.lora.r == 16 and resolved.sft.lora.alpha == 32 and resolved.sft.lora.save == "merged"
    assert (resolved.sft.batch_size, resolved.sft.lr, resolved.sft.max_length) == (8, 1e-3, 1024)
    assert (resolved.rl.lr, resolved.rl.minibatch_size) == (1e-5, 8)
    assert resolved.student.chat_template.endswith("templates/smollm2-compact-tools.jinja")
    assert resolved.sft.precision == resolved.evaluate.precision in ("bf16", "fp32")
    demo, choice = resolve_student(load_pipelines(path)["demo"], tmp_path)
    assert demo.student.model == "tiny" and demo.sft == SFTConfig() and demo.rl == RLConfig()  # tiny: the defaults


def test_keys_a_pipeline_writes_win_over_the_profile(tmp_path):
    from flywheel.train.students import resolve_student

    path = _write(tmp_path, {"pipelines": {"mine": {
        "environment": {"name": "support"}, "student": {"chat_template": None},
        "sft": {"steps": 40, "lr": 5e-4, "precision": "fp32", "validation_tasks": 0}, "rl": {"lr": 2e-5}}}})
    resolved, _ = resolve_student(load_pipelines(path)["mine"], tmp_path)
    assert resolved.student.chat_template is None  # written as null: it stays null
    assert (resolved.sft.steps, resolved.sft.lr, resolved.sft.precision, resolved.sft.validation_tasks) == \
        (40, 5e-4, "fp32", 0)
    assert resolved.sft.batch_size == 8 and resolved.sft.lora is not None  # unwritten: the profile's
    assert resolved.rl.lr == 2e-5 and resolved.rl.minibatch_size == 8
    assert resolved.sft.planned_steps(1000) == 40  # explicit steps win over epochs


def test_planned_steps_follow_the_data_unless_steps_are_set():
    cfg = SFTConfig(epochs=3, batch_size=8)
    assert cfg.planned_steps(100) == 39  # 13 batches a pass (the last one short), 3 passes
    assert cfg.planned_steps(96) == 36 == math.ceil(3 * 96 / 8)
    assert cfg.planned_steps(3) == 3  # fewer conversations than a batch: one (short) batch a pass
    assert SFTConfig(epochs=1.5, batch_size=8).planned_steps(80) == 15
    assert SFTConfig(epochs=0.1, batch_size=8).planned_steps(5) == 1
    assert cfg.planned_steps(0) == 0
    assert SFTConfig(steps=600, batch_size=32).planned_steps(10) == 600


def test_cross_field_rule_is_reported(tmp_path):
    data = _demo()
    data["pipelines"]["demo"]["student"]["tiny"]["heads"] = 3
    with pytest.raises(ConfigError, match="not divisible by heads 3"):
        load_pipelines(_write(tmp_path, data))


@pytest.mark.parametrize("text, expected", [
    ("pipelines: [unclosed", r"pipelines.yaml:1:21: not valid YAML: expected ',' or '\]', but got '<stream end>'"),
    ("pipelines: {}\nextra: 1", "extra: unknown key; the file holds `pipelines:` alone"),
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
                                          r"support-mt, support-smol\)"):
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
    assert result.exit_code == 1
    assert "error: " + str(tmp_path / "pipelines.yaml") + ": pipelines.demo.gate.min_scor: unknown key; did you mean " \
        "'min_score'?" in result.output.splitlines()


def test_cli_check_fails_while_dvc_yaml_is_out_of_date(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app
    from tasks.spec import write_dvc_files

    data = _demo()
    data["pipelines"] = {"demo": data["pipelines"]["demo"]}  # (replay's traces are not in tmp_path)
    _write(tmp_path, data)
    write_dvc_files(tmp_path)
    assert CliRunner().invoke(app, ["check", "--root", str(tmp_path)]).exit_code == 0
    data["pipelines"]["demo"]["collect"]["sources"] = ["logs/agent/*.jsonl"]  # collect@demo now reads logs/agent
    _write(tmp_path, data)
    result = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert result.exit_code == 1
    assert "dvc.yaml is out of date" in result.output and f"flywheel dvc-yaml --root {tmp_path}" in result.output


def test_cli_check_names_a_missing_opd_teacher(tmp_path):
    """On-policy distillation's local teacher is checked before any stage runs (the rl stage is hours later)."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    data = _demo()
    data["pipelines"] = {"demo": data["pipelines"]["demo"]}
    data["pipelines"]["demo"]["rl"] |= {"objective": "opd", "opd": {"teacher": "models/teacher"}}
    _write(tmp_path, data)
    result = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert result.exit_code == 1
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


def test_cli_check_says_a_yaml_syntax_error_in_one_error_line_with_its_line_and_column(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli import app

    _write(tmp_path, "pipelines:\n  demo:\n    sft: {steps: 10}\n   rl: {steps: 2}\n")  # rl one space short
    result = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {tmp_path / 'pipelines.yaml'}:4:4: not valid YAML: expected <block end>, but "
                               "found '<block mapping start>' (while parsing a block mapping that starts at 2:3); "
                               "fix the file there (indent with spaces"), lines[0]


def test_one_bad_pipeline_does_not_stop_the_check_or_the_loading_of_another(tmp_path):
    """`flywheel check` checks each pipeline on its own: the bad one's errors, the good one's ok, exit 1;
    `flywheel check GOOD` passes; load_pipeline(GOOD) loads (what `flywheel run GOOD` and the flows call)."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    data = _demo()
    good = data["pipelines"]["demo"]
    bad = yaml.safe_load(yaml.safe_dump(good)) | {"trigger": None}
    bad["sft"]["learning_rate"] = 0.1
    bad["rl"]["group_size"] = 0
    data["pipelines"] = {"demo": good, "broken": bad}
    path = _write(tmp_path, data)

    every = CliRunner().invoke(app, ["check", "--root", str(tmp_path)])
    assert every.exit_code == 1
    lines = every.output.splitlines()
    assert f"{path}: ok (demo)" in lines
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [f"error: {path}: pipelines.broken.sft.learning_rate: unknown key; did you mean 'lr'?",
                      f"error: {path}: pipelines.broken.rl.group_size: Input should be greater than or equal to 1 "
                      "(got 0)",
                      f"error: {path}: 1 of 2 pipeline(s) failed the check: broken"], every.output
    alone = CliRunner().invoke(app, ["check", "demo", "--root", str(tmp_path)])
    assert alone.exit_code == 0, alone.output
    assert f"{path}: ok (demo)" in alone.output and "error" not in alone.output
    assert CliRunner().invoke(app, ["check", "broken", "--root", str(tmp_path)]).exit_code == 1

    assert load_pipeline("demo", path).sft.lr == good["sft"]["lr"]
    with pytest.raises(ConfigError, match="pipelines.broken.sft.learning_rate") as err:
        load_pipeline("broken", path)
    assert "pipelines.demo" not in str(err.value)
    with pytest.raises(ConfigError, match="pipelines.broken.rl.group_size"):
        load_pipelines(path)  # every pipeline at once (dvc.yaml, `flywheel serve`): each must load


def test_a_launcher_of_other_processes_takes_no_validation_slice(tmp_path):
    from flywheel.train.students import resolve_student

    with pytest.raises(ConfigError, match="validation_tasks picks the checkpoint in the training process"):
        load_pipelines(_write(tmp_path, {"pipelines": {"p": {"environment": {"name": "support"},
                                                             "sft": {"launcher": "ddp", "validation_tasks": 8}}}}))
    cfg = load_pipelines(_write(tmp_path, {"pipelines": {"p": {"environment": {"name": "support"},
                                                               "sft": {"launcher": "ddp"}}}}))["p"]
    assert resolve_student(cfg, tmp_path)[0].sft.validation_tasks == 0  # the profile's slice is left out there
