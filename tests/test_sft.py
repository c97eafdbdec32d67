"""SFT with TRL on the tiny student: real optimiser steps, assistant-only labels, saving, resuming."""

from __future__ import annotations

from itertools import islice

import pytest

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.config import SFTConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.oracle import OraclePolicy
from flywheel.train.encoding import encode_conversation
from flywheel.train.sft import build_sft_trainer, train_sft


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = CalculatorEnv()
    episodes = Harness(env).run(OraclePolicy(env), list(islice(env.generate_tasks(11), 64)))
    return [{"messages": e.messages, "tools": env.tools()} for e in episodes]


def small(**overrides) -> SFTConfig:
    return SFTConfig(**{"steps": 8, "batch_size": 8, "lr": 5e-3, "warmup_steps": 1, "max_length": 128,
                        "log_every": 1, **overrides})


def test_labels_are_masked_outside_assistant_tokens(tiny_student, rows, tmp_path):
    trainer, _, counts = build_sft_trainer(tiny_student, rows, tmp_path / "sft", small(eval_fraction=0.0))
    tokenizer = trainer.processing_class
    example = trainer.train_dataset[0]
    ids, mask = encode_conversation(tokenizer, rows[0]["messages"], rows[0]["tools"], max_length=128)
    assert example["input_ids"] == ids
    assert example["labels"] == [t if m else -100 for t, m in zip(ids, mask, strict=True)]
    assert tokenizer.eos_token_id in example["labels"]  # the model learns to stop
    assert not trainer.args.bf16 and not trainer.args.gradient_checkpointing and trainer.args.learning_rate == 5e-3


def test_steps_lower_the_loss_and_the_saved_model_reloads(tiny_student, rows, tmp_path):
    logged = []
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", small(), on_log=lambda step, m: logged.append((step, m)))
    assert [step for step, _ in logged] == list(range(1, 9))
    assert set(logged[0][1]) >= {"loss", "learning_rate", "grad_norm", "tokens_per_s"}
    assert logged[-1][1]["loss"] < logged[0][1]["loss"]
    assert metrics["steps"] == 8 and metrics["tokens"] > 0 and metrics["resumed_from"] is None
    model, tokenizer = load_student(tmp_path / "sft")
    assert (tmp_path / "sft" / "model.safetensors").exists() and tokenizer.chat_template
    assert model.config.vocab_size == len(tokenizer)


def test_the_loss_is_the_models_own_and_token_accuracy_is_counted(tiny_student, rows, tmp_path):
    import torch

    trainer, _, _ = build_sft_trainer(tiny_student, rows, tmp_path / "sft", small(eval_fraction=0.0))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    asked, forward = [], trainer.model.forward

    def recording(*args, **kwargs):
        asked.append(set(kwargs))
        return forward(*args, **kwargs)

    trainer.model.forward = recording
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    del trainer.model.forward
    assert asked and not any("fused_lm_head" in kwargs for kwargs in asked)  # not TRL's chunked head
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    scored = labels != -100
    by_hand = -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert float(loss) == pytest.approx(float(by_hand[scored].mean()), rel=1e-4)
    accuracy = ((logits[:, :-1].argmax(-1) == labels) & scored).sum() / scored.sum()
    assert trainer._metrics["eval"]["mean_token_accuracy"] == [pytest.approx(float(accuracy))]


def test_bf16_steps_run_under_autocast_and_save_fp32_weights(tiny_student, rows, tmp_path):
    import torch

    trainer, _, _ = build_sft_trainer(tiny_student, rows, tmp_path / "sft", small(precision="bf16"))
    assert trainer.args.bf16 and not trainer.args.fp16
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", small(precision="bf16", eval_fraction=0.0))
    assert metrics["steps"] == 8 and metrics["train_loss"] > 0
    model, _ = load_student(tmp_path / "sft")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_killed_run_resumes_from_its_last_checkpoint(tiny_student, rows, tmp_path):
    def die_at_step_5(step, _):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sft(tiny_student, rows, tmp_path / "sft", small(), on_log=die_at_step_5)
    assert not (tmp_path / "sft").exists()
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", small())
    assert metrics["resumed_from"].endswith("checkpoint-4") and metrics["steps"] == 8
    # Other inputs do not resume from these checkpoints.
    metrics = train_sft(tiny_student, rows[:32], tmp_path / "sft", small())
    assert metrics["resumed_from"] is None


def test_long_conversations_are_cut_or_dropped_and_counted(tiny_student, rows):
    from flywheel.train.sft import sft_records, tokenize_records

    _, tokenizer = load_student(tiny_student)
    records = sft_records(rows)
    template = tokenizer.chat_template
    lengths = [len(encode_conversation(tokenizer, r["messages"], r["tools"], 1 << 20)[0]) for r in rows]
    limit = sorted(lengths)[len(lengths) // 2]
    longer = sum(n > limit for n in lengths)
    assert 0 < longer < len(rows)

    cut = tokenize_records(tokenizer, records, small(max_length=limit, eval_fraction=0.0), template)
    assert cut.counts["truncated"] == longer and cut.counts["dropped_long"] == 0
    assert len(cut.train) == len(rows) and max(len(e["input_ids"]) for e in cut.train) == limit
    dropped = tokenize_records(tokenizer, records, small(max_length=limit, eval_fraction=0.0,
                                                         long_conversations="drop"), template)
    assert dropped.counts["dropped_long"] == longer and len(dropped.train) == len(rows) - longer
    # a cut that leaves no assistant token is dropped and counted; none left at all is an error, not a no-op, and
    # it names the setting that helps: truncating already, only a max_length above the prompt does
    prompt = max(encode_conversation(tokenizer, r["messages"], r["tools"], 1 << 20)[1].index(1) for r in rows)
    with pytest.raises(ValueError, match="no SFT conversation left.*'dropped_no_target': 64") as err:
        tokenize_records(tokenizer, records, small(max_length=16, eval_fraction=0.0), template)
    assert str(err.value).endswith(f"64 conversation(s) were cut at sft.max_length 16 before their first assistant "
                                   f"token, leaving nothing to learn: raise sft.max_length above the longest prompt "
                                   f"before a first assistant token, {prompt} tokens")
    assert "long_conversations" not in str(err.value)
    # dropping long ones left none: truncating helps where every prompt fits, else only a longer max_length
    shortest = min(lengths) - 1
    assert prompt < shortest
    with pytest.raises(ValueError, match=r"'dropped_long': 64.*\(sft.long_conversations: drop\): set "
                                         rf"sft.long_conversations: truncate to train on their first {shortest} "
                                         r"tokens, or raise sft.max_length$"):
        tokenize_records(tokenizer, records, small(max_length=shortest, eval_fraction=0.0, long_conversations="drop"),
                         template)
    with pytest.raises(ValueError, match=rf"drop\): raise sft.max_length above the longest prompt before a first "
                                         rf"assistant token, {prompt} tokens \(truncating at 16 would keep no"):
        tokenize_records(tokenizer, records, small(max_length=16, eval_fraction=0.0, long_conversations="drop"),
                         template)


def test_heldout_slice_is_by_content_and_gives_an_eval_loss(tiny_student, rows, tmp_path):
    from flywheel.train.sft import is_heldout, sft_records

    records = sft_records(rows)
    picked = [is_heldout(r, 0.25) for r in records]
    assert picked == [is_heldout(r, 0.25) for r in reversed(records)][::-1]  # not by position
    assert 0 < sum(picked) < len(records)
    logged = []
    metrics = train_sft(tiny_student, rows, tmp_path / "sft", small(eval_fraction=0.25, eval_every=4),
                        on_log=lambda step, m: logged.append((step, m)))
    assert [step for step, m in logged if "eval_loss" in m] == [4, 8]
    assert metrics["eval_examples"] == sum(picked) and metrics["train_examples"] == len(rows) - sum(picked)
    assert metrics["eval_loss"] == [m for _, m in logged if "eval_loss" in m][-1]["eval_loss"]


def test_a_shared_opening_is_read_once_with_the_same_loss_and_gradients(tiny_student, rows, tmp_path):
    import torch

    from flywheel.envs.support import make_env
    from flywheel.train.opening import shared_opening

    env = make_env(0)  # a long system prompt and four tools: an opening worth reading once
    episodes = Harness(env, Limits(max_turns=6)).run(OraclePolicy(env), list(islice(env.generate_tasks(0), 6)))
    support = [{"messages": e.messages, "tools": env.tools()} for e in episodes]
    trainer, _, _ = build_sft_trainer(tiny_student, support, tmp_path / "sft", small(eval_fraction=0.0,
                                                                                     max_length=4096))
    batch = dict(trainer.data_collator([trainer.train_dataset[i] for i in range(6)]))
    opening = shared_opening(batch["input_ids"], batch["labels"] != -100, batch["attention_mask"])
    first_trained = int((batch["labels"] != -100).any(0).long().argmax())
    assert 32 <= opening < first_trained  # the system prompt and the tools, never a trained token
    model = trainer.model
    model.train()
    torch.manual_seed(0)
    calls = []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k)
    loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=(batch["labels"][:, 1:] != -100).sum())
    del model.forward
    assert calls == [(1, opening), (6, batch["input_ids"].shape[1] - opening)]  # the opening once, then the rests
    loss.backward()
    shared = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    whole = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    whole.backward()
    assert float(loss.detach()) == pytest.approx(float(whole.detach()), rel=1e-5)
    assert shared and all(torch.allclose(shared[n], p.grad, rtol=1e-4, atol=1e-6)
                          for n, p in model.named_parameters() if p.grad is not None)


def test_batches_grouped_by_length_pad_less_than_random_ones(tiny_student, rows, tmp_path):
    """sft.group_by_length: the trainer's batches hold conversations of about one length, so an epoch reads fewer
    padded tokens than random batches of the same conversations (every one still read once)."""
    # conversations of two lengths: each calculator one, and each with a second exchange appended
    longer = [{"messages": r["messages"] + r["messages"][1:], "tools": r["tools"]} for r in rows[:32]]
    mixed = rows[:32] + longer

    def epoch(grouped: bool) -> tuple[int, int]:
        trainer, _, _ = build_sft_trainer(tiny_student, mixed, tmp_path / f"out-{grouped}",
                                          small(group_by_length=grouped, eval_fraction=0.0))
        batches = list(trainer.get_train_dataloader())
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        return sum(b["input_ids"].numel() for b in batches), real

    grouped, random = epoch(True), epoch(False)
    assert grouped[1] == random[1]  # the same tokens read ...
    assert grouped[0] < random[0]  # ... with less padding


def test_a_batch_past_micro_batch_tokens_is_read_in_micro_batches_with_the_same_step(tiny_student, rows, tmp_path):
    """sft.micro_batch_tokens: a batch of 8 conversations of up to 128 tokens with a budget of 256 tokens is read
    as four passes of two, their gradients added: the same losses and gradient norms step by step as one pass."""
    assert small(micro_batch_tokens=256).micro_batch_size() == 2 and small().micro_batch_size() == 8
    assert small(batch_size=6, micro_batch_tokens=4 * 128).micro_batch_size() == 3  # a divisor of the batch
    assert small(max_length=512, micro_batch_tokens=100).micro_batch_size() == 1

    trainer, _, _ = build_sft_trainer(tiny_student, rows, tmp_path / "args", small(micro_batch_tokens=256))
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 4)

    def logged(cfg: SFTConfig, name: str) -> list[dict]:
        out = []
        train_sft(tiny_student, rows, tmp_path / name, cfg, on_log=lambda step, m: out.append(m))
        return out

    whole = logged(small(steps=3, eval_fraction=0.0), "whole")
    parts = logged(small(steps=3, eval_fraction=0.0, micro_batch_tokens=256), "parts")
    assert len(whole) == len(parts) == 3
    for a, b in zip(whole, parts, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
