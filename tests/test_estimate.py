"""`flywheel check`'s time estimate: the student's timed probe and its cache, the arithmetic over a pipeline's
tasks and stages (structure and direction, never speed), and `budget_minutes` refusing a run without a terminal."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from flywheel.agent import load_harness
from flywheel.config import load_pipeline
from flywheel.estimate import STAGE_OVERHEAD_S, STAGES, estimate, padded_length, render
from flywheel.train.probe import PROBE_DIR, measure, probe_key

REPO = Path(__file__).resolve().parent.parent
BIN = Path(__import__("sys").executable).parent

PIPELINE = {"environment": {"name": "calculator", "train_tasks": 80, "heldout_tasks": 20, "seed": 0},
            "student": {"model": "tiny", "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "vocab_size": 400}},
            "teacher": {"policy": "oracle"},
            "collect": {"sources": ["traces/*.jsonl"], "heldout_fraction": 0.2},
            "synthesize": {}, "sft": {"steps": 40, "batch_size": 8, "max_length": 128},
            "rl": {"steps": 2, "tasks_per_step": 4, "group_size": 2}, "evaluate": {}, "gate": {}}


def project(root: Path, **changes) -> Path:
    """A project with one pipeline `p` (PIPELINE, sections updated by `changes`) and one trace file."""
    root.mkdir(parents=True, exist_ok=True)
    pipeline = {key: value | changes.get(key, {}) if isinstance(value, dict) else value
                for key, value in PIPELINE.items()} | {k: v for k, v in changes.items() if k not in PIPELINE}
    (root / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": {"p": pipeline}}))
    (root / "traces").mkdir(exist_ok=True)
    sample = (REPO / "examples/traces/support-agent-2026-11-01.jsonl").read_text().splitlines()[:5]
    (root / "traces" / "a.jsonl").write_text("\n".join(sample) + "\n")
    return root


def loaded(root: Path):
    cfg = load_pipeline("p", root / "pipelines.yaml")
    return cfg, load_harness(cfg.environment, root, pipeline="p")


def test_the_probe_times_the_student_once_and_keeps_it_per_student_and_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_PROBE_DIR", raising=False)
    root = project(tmp_path / "project")
    cfg, _ = loaded(root)
    speed = measure(cfg, root)
    assert not speed.cached and speed.load_s > 0
    # a step is a fixed cost plus a cost a token: longer steps take longer, two steps twice one
    assert speed.train_fixed_s >= 0 and speed.train_token_s > 0 and speed.forward_token_s > 0
    assert 0 < speed.train_step_s(64) < speed.train_step_s(8 * 64)
    assert speed.train_time(2 * 8 * 64, steps=2) == pytest.approx(2 * speed.train_step_s(8 * 64))
    assert speed.forward_time(8 * 64) <= speed.train_step_s(8 * 64)
    assert set(speed.decode_step_s) == {1, 8, 64} and all(t > 0 for t in speed.decode_step_s.values())
    # more rows never take less time a step; between the measured batch sizes, on the line between them
    assert speed.decode_s(1) <= speed.decode_s(8) <= speed.decode_s(30) <= speed.decode_s(64) <= speed.decode_s(128)
    assert speed.decode_s(4) > 0
    kept = list((root / PROBE_DIR).glob("*.json"))
    assert len(kept) == 1
    # another pipeline with the same student (another batch, other tasks): read back, not timed again
    again = measure(cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"batch_size": 4})}), root)
    assert again.cached and again.train_token_s == speed.train_token_s and again.decode_step_s == speed.decode_step_s
    # another thread count or student is another probe
    assert probe_key(cfg, 1) != probe_key(cfg, 2)
    bigger = cfg.model_copy(update={"student": cfg.student.model_copy(update={
        "tiny": cfg.student.tiny.model_copy(update={"hidden_size": 64})})})
    assert probe_key(bigger, 2) != probe_key(cfg, 2)
    kept[0].write_text("{not json")  # a damaged record is measured again
    assert not measure(cfg, root).cached

    # two checks at once (threads here; processes alike: the lock is the file's): one probes, the other waits
    # for its record and reads it
    from concurrent.futures import ThreadPoolExecutor

    kept[0].unlink()
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: measure(cfg, root), range(2)))
    assert sorted(s.cached for s in both) == [False, True] and both[0].train_token_s == both[1].train_token_s


def test_the_estimate_adds_up_and_grows_with_what_a_stage_does(tmp_path):
    root = project(tmp_path / "project")
    cfg, harness = loaded(root)
    est = estimate("p", cfg, harness, root)
    assert set(est.seconds) == set(STAGES) and est.complete
    assert all(s > 0 for s in est.seconds.values())
    assert est.total == pytest.approx(sum(est.seconds.values()))
    convs, speed = est.conversations, est.speed
    assert convs.sampled == 16 and convs.passed == 1.0 and convs.turns >= 2 and convs.solver_s > 0
    assert all(length > convs.prompt_tokens for length in convs.lengths)
    # SFT's length is the seam's: planned_steps of the train tasks' targets (less the eval loss's slice)
    steps = int(est.inputs["sft"].split(" steps")[0])
    examples = int(est.inputs["sft"].split("planned_steps(")[1].split(")")[0])
    assert steps == cfg.sft.planned_steps(examples)
    width = padded_length(convs.lengths, cfg.sft.batch_size, cfg.sft.max_length)  # random batches (the default)
    # batches grouped by length (sft.group_by_length) pad less than random ones
    assert padded_length(convs.lengths, cfg.sft.batch_size, cfg.sft.max_length, grouped_from=examples) <= width
    opening = min(convs.opening, width)  # (read once a batch)
    assert est.seconds["sft"] >= speed.train_time(steps * (opening + cfg.sft.batch_size * (width - opening)), steps)
    assert est.sft_shape == (cfg.sft.micro_batch_size(), width) and cfg.sft.micro_batch_size() == cfg.sft.batch_size
    params = est.params()
    assert params["estimate.total_s"] == pytest.approx(est.total, abs=0.1) and "estimate.sft_s" in params
    lines = render(est)
    assert [line.split()[0] for line in lines if line.split()[0] in (*STAGES, "total")] == [*STAGES, "total"]

    # the same student (its probe kept): more RL steps, more evaluation episodes, more samples take longer
    more = project(tmp_path / "more", rl={"steps": 4}, evaluate={"samples": 1},
                   synthesize={"samples_per_task": 3})
    cfg2, harness2 = loaded(more)
    est2 = estimate("p", cfg2, harness2, more)
    assert est2.speed == speed or est2.speed.cached  # (the session's probe folder, or this project's)
    assert est2.seconds["rl"] > est.seconds["rl"] and est2.seconds["evaluate"] > est.seconds["evaluate"]
    # synthesize: the solver's time is measured in each estimate (microseconds an episode, noisy): per solver-second
    def solver_episodes(e):
        return (e.seconds["synthesize"] - STAGE_OVERHEAD_S) / e.conversations.solver_s
    assert solver_episodes(est2) == pytest.approx(3 * solver_episodes(est), rel=1e-6)
    # the oracle says one thing n times: its duplicates are dropped, so SFT's examples do not grow with n
    assert est2.inputs["sft"] == est.inputs["sft"]
    none = project(tmp_path / "none", rl={"steps": 0})
    assert estimate("p", *loaded(none), none).seconds["rl"] == 0.0


def test_a_run_over_its_budget_without_a_terminal_stops_with_the_estimate(tmp_path):
    root = project(tmp_path / "project", budget_minutes=0.01)
    ran = subprocess.run([str(BIN / "flywheel"), "run", "p", "--root", str(root)], capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert ran.returncode != 0
    said = " ".join(ran.stderr.split())
    assert "over budget_minutes 0.01" in said and "--yes" in said and "nothing was started" in said
    assert "pipelines.p.budget_minutes" in said and "sft" in said
    assert not (root / "data").exists()  # no stage ran
    checked = subprocess.run([str(BIN / "flywheel"), "check", "p", "--root", str(root)], capture_output=True,
                             text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr
    out = " ".join(checked.stdout.split())
    assert "estimated time" in out and "synthesize" in out and "total" in out and "over budget_minutes" in out


def test_the_budget_is_no_stage_input_and_samples_and_seeds_are_synthesize_inputs(tmp_path):
    """budget_minutes changes no stage's cache key (a rerun runs nothing); samples_per_task and the environment's
    seed (the teacher's sampling seed) change synthesize's."""
    from tasks.spec import input_key

    def keys(**changes) -> dict[str, str]:
        root = project(tmp_path / "p", **changes)
        return {stage: input_key(stage, "p", root) for stage in ("collect", "synthesize", "sft", "rl", "evaluate")}

    plain = keys()
    assert keys(budget_minutes=5) == plain
    assert keys(synthesize={"samples_per_task": 4})["synthesize"] != plain["synthesize"]
    assert keys(environment={"seed": 1})["synthesize"] != plain["synthesize"]


def test_samples_a_teacher_cannot_vary_are_a_warning_naming_the_key():
    from flywheel.cli.preflight import same_samples
    from flywheel.config import PipelineConfig

    def cfg(teacher: dict, synthesize: dict) -> PipelineConfig:
        return PipelineConfig.model_validate(PIPELINE | {"teacher": teacher, "synthesize": synthesize})

    oracle = same_samples("p", cfg({"policy": "oracle"}, {"samples_per_task": 3}))
    assert len(oracle) == 1 and "pipelines.p.synthesize.samples_per_task 3" in oracle[0] and "2 of" in oracle[0]
    greedy = same_samples("p", cfg({"policy": "hf", "model": "m"}, {"samples_per_task": 2}))
    assert len(greedy) == 1 and "temperature 0" in greedy[0]
    assert same_samples("p", cfg({"policy": "hf", "model": "m"}, {"samples_per_task": 2, "temperature": 0.8})) == []
    assert same_samples("p", cfg({"policy": "oracle", "error_rate": 0.2}, {"samples_per_task": 2})) == []
    assert same_samples("p", cfg({"policy": "oracle"}, {})) == []


def test_the_summary_puts_each_measured_stage_time_beside_its_estimate():
    from flywheel.cli.render import times_line

    line = times_line({"collect": 2.0, "sft": 61.0}, {"estimate.sft_s": 107.0, "estimate.total_s": 110.0})
    assert line == "collect 0:02, sft 1:01 (1:47, x0.57), total 1:03 (1:50)"
    assert times_line({"sft": 5.0}, {}) == "sft 0:05, total 0:05"  # a run without an estimate: its times alone
