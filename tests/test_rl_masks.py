"""Constrained decoding's token masks reach the learner: its log-probabilities are those of the distribution each
token was sampled from (tempered, masked, renormalised), so the importance ratio is 1 for an unchanged policy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flywheel.agent import Episode
from flywheel.checkpoints import load_student
from flywheel.config import OPDConfig, RLConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Completion
from flywheel.policies.toolcalls import canonical_messages
from flywheel.train.rl.batch import collate, make_groups, samples_of
from flywheel.train.rl.learner import batch_logprobs, learn_on_batch
from flywheel.train.rl.loss import MASK_KEYS, TokenMasks, token_distributions
from flywheel.train.rl.opd import exact_divergence
from flywheel.train.rl.teacher import LocalTeacher

TEMPERATURE = 1.0
GROUP = 3


@torch.no_grad()
def sample_turn(model, tokenizer, messages: list[dict], tools: list[dict], rng: np.random.Generator,
                steps: int = 12, within: list[int] | None = None) -> Completion:
    """One assistant turn sampled by hand as a constrained sampler does: logits -> temperature -> a random mask
    -> softmax -> sample; the logprob reported is of that distribution. The mask: at about two positions in
    three, a random 30% of the vocabulary; with `within`, at every position a random part of those tokens."""
    prompt = tokenizer.apply_chat_template(canonical_messages(messages), tools=tools, add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    ids, logprobs, masks = list(prompt), [], {}
    for i in range(steps):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / TEMPERATURE
        allowed = None
        if within is not None:
            allowed = np.zeros(logits.shape[0], dtype=bool)
            allowed[[t for t in within if rng.random() < 0.6] or within[:1]] = True
        elif rng.random() < 2 / 3:
            allowed = rng.random(logits.shape[0]) < 0.3
            allowed[rng.integers(logits.shape[0])] = True
        if allowed is not None:
            logits = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
            masks[i] = np.packbits(allowed)
        logp = torch.log_softmax(logits, -1)
        token = int(rng.choice(len(logp), p=logp.exp().double().numpy() / logp.exp().double().sum().item()))
        ids.append(token)
        logprobs.append(float(logp[token]))
        if token == tokenizer.eos_token_id:
            break
    generated = ids[len(prompt):]
    text = tokenizer.decode([t for t in generated if t != tokenizer.eos_token_id], skip_special_tokens=True)
    return Completion(message={"role": "assistant", "content": text}, token_ids=generated, logprobs=logprobs,
                      masks=masks)


@pytest.fixture(scope="module")
def masked_batch(tiny_student):
    """Two-turn episodes (an answer, the user's word, another answer) sampled under random masks, through
    make_groups and collate as the RL loop builds its batch; the model they were sampled from."""
    model, tokenizer = load_student(tiny_student)
    model.eval()
    env = CalculatorEnv()
    tools = env.tools()
    rng = np.random.default_rng(0)
    # digits are tokens of their own that never merge: a turn of digits re-tokenises into the ids sampled, so
    # the second task's episodes are encoded whole; the first's, of any tokens, turn by turn (split)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)] + [tokenizer.eos_token_id]
    episodes = []
    for task, within in zip(itertools.islice(env.generate_tasks(5), 2), [None, digits], strict=True):
        for sample in range(GROUP):
            messages = [dict(m) for m in task.prompt]
            turns = []
            for _ in range(2):
                turn = sample_turn(model, tokenizer, messages, tools, rng, within=within)
                turns.append(turn)
                messages += [turn.message, {"role": "user", "content": "Go on."}]
            episodes.append(Episode(task=task, sample=sample, messages=messages[:-1], reward=float(sample),
                                    completions=turns, stop="answer"))
    groups = make_groups(episodes, GROUP, tokenizer, tools, max_length=512, step=0, version=0)
    samples = [s for g in groups for s in samples_of(g, [1.0, 0.0, -1.0])]
    return model, collate(samples, tokenizer.pad_token_id or tokenizer.eos_token_id), groups


def test_the_learner_scores_masked_tokens_as_they_were_sampled(masked_batch):
    model, batch, groups = masked_batch
    assert all(key in batch for key in MASK_KEYS) and len(batch["mask_rows"]) > 10
    # every masked position is a token the loss sees, whichever way the episode was encoded
    assert bool((batch["loss_mask"][batch["mask_rows"], batch["mask_positions"]] == 1).all())
    on = batch["loss_mask"] > 0
    behaviour = batch["behaviour_logprobs"][on]
    learner = batch_logprobs(model, batch, chunk=4, temperature=TEMPERATURE)[on]
    torch.testing.assert_close(learner, behaviour, atol=1e-5, rtol=0)
    # the importance ratio of the unchanged policy is 1
    assert float((learner - behaviour).exp().sub(1).abs().max()) < 1e-5
    # without the masks the learner would score another distribution: the masked positions' ratios are off
    unmasked = {k: v for k, v in batch.items() if k not in MASK_KEYS}
    plain = batch_logprobs(model, unmasked, chunk=4, temperature=TEMPERATURE)[on]
    assert float((plain - behaviour).abs().max()) > 0.1
    assert float(plain.sum()) < float(behaviour.sum())  # renormalising over fewer tokens raises each
    # both encodings were taken: the whole conversation (second task) and turn by turn (first)
    assert [r.split for r in groups[0].rollouts] == [True] * GROUP
    assert [r.split for r in groups[1].rollouts] == [False] * GROUP


def test_a_learner_step_of_an_unchanged_policy_sees_ratio_one(masked_batch, tiny_student):
    _, batch, _ = masked_batch
    model = load_student(tiny_student)[0]
    cfg = RLConfig(group_size=GROUP, epochs_per_batch=1, minibatch_size=64, lr=1e-3, temperature=TEMPERATURE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    stats = learn_on_batch(model, optimizer, batch, cfg, torch.Generator().manual_seed(0))
    assert stats["updates"] == 1
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-5) and stats["kl_behaviour"] < 1e-8
    unmasked = {k: v for k, v in batch.items() if k not in MASK_KEYS}
    stats = learn_on_batch(load_student(tiny_student)[0], torch.optim.AdamW(model.parameters(), lr=0.0),
                           unmasked, cfg, torch.Generator().manual_seed(0))
    assert stats["is_weight_mean"] < 0.95 and stats["kl_behaviour"] > 1e-3


def test_minibatches_and_the_teacher_take_each_rows_own_masks(masked_batch, tiny_student):
    model, batch, _ = masked_batch
    masks = TokenMasks.of(batch)
    n = len(batch["input_ids"])
    rows = torch.tensor([n - 1, 0])  # reordered, as a shuffled minibatch is
    wanted = batch["loss_mask"][rows] > 0
    with torch.no_grad():
        picked, distributions = token_distributions(model, batch["input_ids"][rows], batch["attention_mask"][rows],
                                                    wanted, TEMPERATURE, masks.select(rows, n))
    torch.testing.assert_close(picked[wanted], batch["behaviour_logprobs"][rows][wanted], atol=1e-5, rtol=0)
    assert bool(torch.isinf(distributions).any())  # disallowed tokens: probability 0
    # the student as its own teacher: the same masked distributions, so no divergence and finite gradients
    teacher = LocalTeacher(tiny_student, device="cpu")
    assert teacher.logprobs(batch)[batch["loss_mask"] > 0].sub(batch["behaviour_logprobs"][batch["loss_mask"] > 0]) \
        .abs().max() < 1e-5
    targets = teacher.distributions(batch["input_ids"][rows], batch["attention_mask"][rows], wanted,
                                    masks.select(rows, n))
    student = distributions.clone().requires_grad_(True)
    for kind in ("reverse", "forward"):
        divergence = exact_divergence(student, targets, kind)
        assert float(divergence.detach().abs().max()) < 1e-4
        divergence.sum().backward()
        assert bool(torch.isfinite(student.grad).all())
    assert OPDConfig(teacher=str(tiny_student), divergence="forward").divergence == "forward"


def test_a_mask_that_rules_out_its_own_token_is_refused(masked_batch, tiny_student):
    from flywheel.train.rl.batch import check_masks

    model, tokenizer = load_student(tiny_student)
    task = next(CalculatorEnv().generate_tasks(5))
    turn = sample_turn(model, tokenizer, [dict(m) for m in task.prompt], CalculatorEnv().tools(),
                       np.random.default_rng(1), steps=3)
    allowed = np.ones(model.config.vocab_size, dtype=bool)
    allowed[turn.token_ids[0]] = False
    turn.masks = {0: np.packbits(allowed)}
    episode = Episode(task=task, sample=0, messages=[*task.prompt, turn.message], completions=[turn])
    with pytest.raises(ValueError, match="not allowed by it"):
        check_masks(episode)


def test_the_first_minibatch_takes_its_old_logprobs_from_its_own_pass(masked_batch, tiny_student):
    """The weights have not moved before the first minibatch's step, so its old log-probabilities are its new
    ones: no pass without gradient over those rows (with one minibatch, none at all), and the ratio is still 1."""
    _, batch, _ = masked_batch
    n = len(batch["input_ids"])
    for minibatch, expected_rows in ((64, 0), (4, n - 4)):
        model = load_student(tiny_student)[0]
        scored: list[int] = []  # rows of each forward pass run without gradient (a shared opening's read aside)

        def count(_, args, kwargs, scored=scored):
            if not torch.is_grad_enabled() and not kwargs.get("use_cache"):
                scored.append(kwargs["input_ids"].shape[0])

        model.register_forward_pre_hook(count, with_kwargs=True)
        cfg = RLConfig(group_size=GROUP, epochs_per_batch=1, minibatch_size=minibatch, lr=1e-3)
        stats = learn_on_batch(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), batch, cfg,
                               torch.Generator().manual_seed(0))
        assert sum(scored) == expected_rows
        assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and stats["kl_behaviour"] < 1e-8
