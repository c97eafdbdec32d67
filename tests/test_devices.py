"""Where the student and local teachers run: the `device` settings, chosen on CPU here.

No GPU is lent to this project's tests: what needs one is checked as far as the choice (the setting reaches the
part that places the model, and a GPU that is not there is a clear error, never a silent CPU run). Where a test
pretends a GPU is present it patches torch's CUDA queries only; nothing is placed on it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
import types

import pytest
import torch
import yaml

from flywheel.agent import Harness, Limits
from flywheel.config import ConfigError, RLConfig, TeacherConfig, load_pipelines
from flywheel.devices import actor_device, pin_visible_gpu, resolve_device

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_cuda_when_present_else_cpu(monkeypatch):
    _gpus(monkeypatch, 0)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(RuntimeError, match="student.device: 'cuda' but no CUDA GPU is visible"):
        resolve_device("cuda", "student.device")
    _gpus(monkeypatch, 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(RuntimeError, match=r"rl.actor_devices\[0\]: 'cuda:2' but this machine shows 2 CUDA GPU"):
        resolve_device("cuda:2", "rl.actor_devices[0]")


def test_each_actor_gets_its_own_device_or_the_students():
    assert [actor_device("auto", [], i) for i in range(2)] == ["auto", "auto"]
    assert [actor_device("cuda:0", ["cuda:1", "cuda:2"], i) for i in range(2)] == ["cuda:1", "cuda:2"]


def _config(tmp_path, **sections) -> str:
    base = {s: {} for s in ("environment", "student", "teacher", "collect", "synthesize", "sft", "rl", "evaluate",
                            "gate")}
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"pipelines": {"p": base | sections}}))
    return path


@pytest.mark.parametrize(("sections", "message"), [
    ({"student": {"device": "gpu"}}, "pipelines.p.student.device"),
    ({"rl": {"actors": 2, "actor_devices": ["cuda:1"]}}, "names 1 device(s) for 2 actor(s)"),
    ({"rl": {"actors": 1, "actor_devices": ["cuda:one"]}}, "actor_devices ['cuda:one']"),
    ({"rl": {"actors": 0, "generation": "vllm"}}, "generation 'vllm' needs actors >= 1"),
    ({"rl": {"actors": 1, "generation": "vllm", "actor_devices": ["cpu"]}}, "an actor on cpu is not possible"),
    ({"teacher": {"policy": "vllm", "model": "m", "device": "cpu"}}, "'vllm' runs on a GPU only"),
])
def test_bad_device_settings_are_config_errors(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_pipelines(_config(tmp_path, **sections))


def test_good_device_settings_load(tmp_path):
    cfg = load_pipelines(_config(tmp_path, student={"device": "cuda:0"}, teacher={"policy": "hf", "model": "m"},
                                 rl={"actors": 2, "actor_devices": ["cuda:1", "cuda:2"], "generation": "vllm"}))["p"]
    assert cfg.student.device == "cuda:0" and cfg.teacher.device == "auto"
    assert cfg.rl.actor_devices == ["cuda:1", "cuda:2"]


def test_a_gpu_index_for_vllm_is_made_the_only_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pin_visible_gpu("cuda:1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    pin_visible_gpu("cuda")  # no index: the process's GPUs as they are
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    pin_visible_gpu("cuda:2")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=0 shows 1 GPU"):
        pin_visible_gpu("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA starts in this process"):
        pin_visible_gpu("cuda:0", "rl.actor_devices[0]")


def test_hf_policy_loads_on_the_device_asked(tiny_student):
    from flywheel.policies.hf import HFPolicy

    assert next(HFPolicy(tiny_student, device="cpu").model.parameters()).device.type == "cpu"
    auto = HFPolicy(tiny_student)  # auto: CUDA when present
    assert next(auto.model.parameters()).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@no_gpu
def test_evaluate_and_rl_take_the_student_device(tiny_student, tmp_path):
    """The setting reaches the code that places the model: a GPU asked for on a CPU machine is the error."""
    from flywheel.envs.calculator import CalculatorEnv
    from flywheel.evaluate.runner import evaluate_model
    from flywheel.train.rl.loop import train_rl

    env = CalculatorEnv()
    tasks = list(itertools.islice(env.generate_tasks(0), 4))
    harness = Harness(env, Limits(max_turns=1, tool_timeout_s=1.0))
    with pytest.raises(RuntimeError, match="hf policy for .*'cuda' but no CUDA GPU"):
        evaluate_model(tiny_student, harness, tasks, "rl", batch_size=4, device="cuda")
    assert len(evaluate_model(tiny_student, harness, tasks, "rl", batch_size=4, device="cpu").rows) == 4
    cfg = RLConfig(steps=1, tasks_per_step=2, group_size=2, max_new_tokens=4, actors=0)
    with pytest.raises(RuntimeError, match=r"student.device \(the RL learner\): 'cuda:0' but no CUDA GPU"):
        train_rl(tiny_student, Harness(env, Limits(max_turns=1)), tasks, cfg, tmp_path / "rl", device="cuda:0")


@no_gpu
def test_an_actor_runs_on_its_own_device(tiny_student, tmp_path):
    """rl.actor_devices reaches the actor process: the actor asked for a GPU fails there, and says so."""
    from test_rl_loop import GradedCalculator

    from flywheel.envs.calculator import CalculatorEnv
    from flywheel.train.rl.loop import train_rl

    tasks = list(itertools.islice(CalculatorEnv().generate_tasks(1), 8))
    cfg = RLConfig(steps=1, tasks_per_step=2, group_size=2, max_new_tokens=4, actors=1, actor_devices=["cuda:1"],
                   checkpoint_every=0)
    with pytest.raises(RuntimeError, match="'cuda:1' but no CUDA GPU is visible"):
        train_rl(tiny_student, Harness(GradedCalculator(), Limits(max_turns=1)), tasks, cfg, tmp_path / "rl",
                 device="cpu")


def test_a_local_teacher_resolves_against_the_project_root(tiny_student, tmp_path, monkeypatch):
    from flywheel.envs.calculator import CalculatorEnv
    from tasks.synthesize import build_teacher

    root = tmp_path / "project"
    shutil.copytree(tiny_student, root / "models" / "teacher")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a stage run from another folder (a worker, `dvc repro` in a subfolder)
    teacher = build_teacher(TeacherConfig(policy="hf", model="models/teacher", device="cpu"), CalculatorEnv(), root)
    assert next(teacher.model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'cuda' but no CUDA GPU"):
            build_teacher(TeacherConfig(policy="hf", model="models/teacher", device="cuda"), CalculatorEnv(), root)


@no_gpu
def test_vllm_refuses_the_cpu_before_importing_vllm():
    from flywheel.policies.vllm import VLLMPolicy

    for device in ("cpu", "auto"):
        with pytest.raises(RuntimeError, match="vLLM runs on a CUDA GPU only"):
            VLLMPolicy("models/x", device=device)


def test_vllm_completions_share_the_batch_latency(monkeypatch):
    """vLLM itself cannot run here: a stand-in engine answers the batch in a known time, as LLM.chat would."""
    from flywheel.policies.base import Sampling
    from flywheel.policies.vllm import VLLMPolicy

    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", fake)

    def output(i):
        step = types.SimpleNamespace(logprob=-0.5)
        generated = types.SimpleNamespace(token_ids=[10 + i, 11], text=f"{i}", logprobs=[{10 + i: step}, {11: step}])
        return types.SimpleNamespace(outputs=[generated], prompt_token_ids=[1, 2, 3])

    class Engine:
        def chat(self, conversations, sampling_params, tools, use_tqdm):
            time.sleep(0.4)
            return [output(i) for i in range(len(conversations))]

    policy = VLLMPolicy.__new__(VLLMPolicy)
    policy.llm = Engine()
    conversations = [[{"role": "user", "content": str(i)}] for i in range(4)]
    completions = policy.generate(conversations, [], Sampling(temperature=1.0, max_new_tokens=2, seed=0))
    latencies = [c.latency_s for c in completions]
    assert len(set(latencies)) == 1 and 0.1 <= latencies[0] < 0.2  # a quarter of the 0.4 s call each
    assert completions[1].token_ids == [11, 11] and completions[1].logprobs == [-0.5, -0.5]
