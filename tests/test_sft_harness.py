"""The tokens SFT trains on are the tokens the harness feeds and generates: a student memorises one multi-turn
tool conversation, then the episode loop (Harness.run + HFPolicy on the saved student) plays it back."""

from __future__ import annotations

from itertools import islice

import pytest
from family_students import build_family_student, calculator_rows

from flywheel.agent import Harness, Limits
from flywheel.config import SFTConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.hf import HFPolicy
from flywheel.policies.oracle import OraclePolicy
from flywheel.policies.toolcalls import canonical_messages
from flywheel.train.sft import build_sft_trainer, train_sft


def tool_episode():
    """An oracle episode: user, assistant tool call, tool result, assistant answer."""
    env = CalculatorEnv()
    [episode] = Harness(env).run(OraclePolicy(env), list(islice(env.generate_tasks(5), 1)))
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    return env, episode


@pytest.mark.parametrize("family", ["tiny", "qwen"])
def test_sft_tokens_equal_the_episode_loops_tokens(family, tiny_student, tmp_path):
    env, oracle = tool_episode()
    row = {"messages": oracle.messages, "tools": env.tools()}
    base = tiny_student if family == "tiny" else build_family_student("qwen", tmp_path / "base", calculator_rows())
    cfg = SFTConfig(steps=150, batch_size=4, lr=3e-3, warmup_steps=2, max_length=1024, eval_fraction=0.0,
                    log_every=10)
    train_sft(base, [row] * 4, tmp_path / "sft", cfg)

    policy = HFPolicy(tmp_path / "sft")
    [episode] = Harness(env, Limits(max_turns=4)).run(policy, [oracle.task])
    assert episode.passed and episode.messages == oracle.messages  # it plays the conversation back

    trainer, _, _ = build_sft_trainer(tmp_path / "sft", [row], tmp_path / "again", cfg)
    trained = trainer.train_dataset[0]
    ids, labels = trained["input_ids"], trained["labels"]
    tokenizer = policy.tokenizer
    assert tokenizer.chat_template == trainer.processing_class.chat_template  # the student ships its template
    generated_at, starts = [], []
    turns = [i for i, m in enumerate(oracle.messages) if m["role"] == "assistant"]
    for turn, completion in zip(turns, episode.completions, strict=True):
        # exactly what HFPolicy feeds: the conversation so far with the generation prompt
        prompt = tokenizer.apply_chat_template(canonical_messages(episode.messages[:turn]), tools=env.tools(),
                                               add_generation_prompt=True, tokenize=True, return_dict=True)
        fed = list(prompt["input_ids"])
        assert ids[:len(fed) + len(completion.token_ids)] == fed + completion.token_ids
        generated_at += range(len(fed), len(fed) + len(completion.token_ids))
        starts.append(len(fed))
    end = generated_at[-1] + 1
    # After the last end-of-turn token the template writes only what follows every assistant turn.
    assert ids[end:] == tokenizer.encode(tokenizer.decode(ids[end:]), add_special_tokens=False)
    trained_at = [i for i, label in enumerate(labels) if label != -100]
    assert set(generated_at) <= set(trained_at)
    for i in set(trained_at) - set(generated_at):
        # trained but fed rather than generated: only a newline the template writes inside {% generation %}
        # next to a turn (Qwen's after `assistant` and after <|im_end|>), which the harness feeds as it renders it
        assert tokenizer.decode([ids[i]]) == "\n" and (i + 1 in starts or ids[i - 1] == tokenizer.eos_token_id)
    assert all(labels[i] == ids[i] for i in trained_at)
