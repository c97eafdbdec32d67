"""The peer benchmark gives TRL's rollouts the prompt the project's harness gives: the same tools in the same order."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peer_rl():
    if str(ROOT / "benchmarks") not in sys.path:  # as when run as a script: its folder first, for its helpers
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("peer_rl", ROOT / "benchmarks" / "peer_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_offers_the_environments_tools_in_the_environments_order(tiny_student, tmp_path):
    """TRL lists an environment's methods alphabetically; the support desk's SFT student, offered cancel_order
    before find_user, wrote before looking the user up and every TRL rollout scored 0. The benchmark reorders them
    to the environment's order, and the prompt TRL renders is then the harness's, token for token."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from flywheel.envs.support import make_env

    peer_rl = _peer_rl()
    env = make_env()
    task = next(iter(env.generate_tasks(0)))
    names = [t["function"]["name"] for t in env.tools()]
    assert names != sorted(names)  # else the order could not tell the two apart

    tokenizer = AutoTokenizer.from_pretrained(tiny_student)
    tokenizer.padding_side = "left"
    tokenizer.response_template = qwen3_template  # as run_trl sets it
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=8, use_cpu=True, report_to=[], save_strategy="no")
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_student), args=args,
                          reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          train_dataset=Dataset.from_list([{"prompt": task.prompt, "task_id": task.task_id}]),
                          processing_class=tokenizer,
                          environment_factory=peer_rl.trl_environment(env, {task.task_id: task}, 5.0))
    assert [m.__name__ for m in trainer._env_tools[None]] == sorted(names)  # TRL's own order

    peer_rl.offer_in_order(trainer, env)
    assert [m.__name__ for m in trainer._env_tools[None]] == names
    assert [m.__name__ for m in trainer.tools] == names
    harness = tokenizer.apply_chat_template(task.prompt, tools=env.tools(), add_generation_prompt=True,
                                            tokenize=False)
    trl = tokenizer.apply_chat_template(task.prompt, tools=trainer._env_tools[None], add_generation_prompt=True,
                                        tokenize=False)
    assert trl == harness
