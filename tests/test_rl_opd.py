"""On-policy distillation (rl.objective opd, reward+opd): the per-token loss by hand, a local teacher and one
served over HTTP (the test OpenAI server scoring prompt log-probabilities with the same checkpoint) giving the
same learner step, tool results carrying no KL, resume, and the teacher's failures: another tokenizer, no
log-probabilities, a server that dies mid-run, NaN log-probabilities. The exact divergences (rl.opd.divergence
reverse, forward) by hand, against a plain forward pass, and as a run."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from openai_server import OracleServer
from pydantic import ValidationError
from test_rl_loop import as_sampled, oracle_episodes, weights

from flywheel.agent import Harness, Limits
from flywheel.checkpoints import load_student
from flywheel.config import OPDConfig, RLConfig, TinyModelConfig
from flywheel.envs.calculator import CalculatorEnv
from flywheel.policies.base import Sampling
from flywheel.policies.hf import HFPolicy
from flywheel.train.rl.batch import collate, make_groups, samples_of
from flywheel.train.rl.learner import learn_on_batch
from flywheel.train.rl.loop import train_rl
from flywheel.train.rl.loss import policy_loss
from flywheel.train.rl.opd import NonFiniteTeacher, distill_advantages, exact_divergence, with_teacher
from flywheel.train.rl.teacher import LocalTeacher, OPDSetupError, ServerTeacher
from flywheel.train.tiny import build_tiny_student, environment_corpus


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_student):
    """Another model with the student's tokenizer (the same corpus and vocabulary): wider, seeded apart."""
    corpus = environment_corpus(CalculatorEnv(), n=300, seed=0)
    path = build_tiny_student(corpus, TinyModelConfig(hidden_size=48, layers=2, heads=2, vocab_size=400, seed=7),
                              tmp_path_factory.mktemp("teacher"))
    assert load_student(path)[1].get_vocab() == load_student(tiny_student)[1].get_vocab()
    return path


@pytest.fixture(scope="module")
def tasks():
    return list(itertools.islice(CalculatorEnv().generate_tasks(5), 12))


CFG = RLConfig(steps=3, tasks_per_step=3, group_size=2, minibatch_size=8, lr=1e-3, max_new_tokens=16, seed=3,
               actors=0, max_staleness=0, checkpoint_every=0, objective="opd",
               opd=OPDConfig(teacher="(given)", kl_coef=1.0))


def changed(cfg: RLConfig, opd: dict | None = None, **rl) -> RLConfig:
    """cfg with these rl keys and rl.opd fields changed, validated as pipelines.yaml is (the objective holds
    rl.opd, so the two change together)."""
    data = cfg.model_dump() | rl
    return RLConfig.model_validate(data | {"opd": data["opd"] | (opd or {})})


def test_opd_advantages_and_loss_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    teacher = torch.tensor([[0.0, -0.5, -3.0, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    adv, stats = distill_advantages(old, teacher, mask, torch.zeros(1), kl_coef=0.5, reward_coef=0.0)
    # -0.5 * (old - teacher) on the two masked tokens; the unmasked last token gets nothing however far apart
    assert adv.tolist() == [[0.0, 0.25, -0.5, 0.0]]
    assert stats["teacher_kl"] == pytest.approx(((-1.0 + 0.5) + (-2.0 + 3.0)) / 2)
    logprobs = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # ratio 1: the loss is -mean(advantage) over the sequence's masked tokens
    assert loss.item() == pytest.approx(-(0.25 - 0.5) / 2)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -0.125, 0.25, 0.0]]
    # reward+opd adds the group's reward advantage to every masked token
    both, _ = distill_advantages(old, teacher, mask, torch.tensor([0.3]), kl_coef=0.5, reward_coef=2.0)
    assert both[0].tolist() == pytest.approx([0.0, 0.85, 0.1, 0.0])


def _batch(student_path, tasks):
    """A collated batch of the student's own sampled calculator episodes (with tool results in them)."""
    env = CalculatorEnv()
    policy = HFPolicy(student_path)
    episodes = Harness(env, Limits(max_turns=2)).run(policy, tasks[:4], samples=2,
                                                     sampling=Sampling(temperature=1.0, max_new_tokens=16, seed=0))
    groups = make_groups(episodes, 2, policy.tokenizer, env.tools(), 128, 0, 0)
    return collate([s for g in groups for s in samples_of(g, [0.0] * len(g.rollouts))],
                   policy.tokenizer.pad_token_id)


def test_a_served_teacher_gives_the_local_teachers_step(tiny_student, teacher, tasks):
    batch = _batch(tiny_student, tasks)
    local = LocalTeacher(teacher, "cpu")
    with OracleServer(logprob_model=str(teacher)) as server:
        served = ServerTeacher(OPDConfig(teacher="opd-teacher", base_url=server.url))
        served.check(load_student(tiny_student)[1])
        by_server = served.logprobs(batch)
        assert [b["model"] for b in server.received[1:]] == ["opd-teacher"] * len(batch["input_ids"])
    by_local = local.logprobs(batch)
    scored = batch["loss_mask"].bool()  # the student's tokens: the only ones the learner asks about
    assert scored.any() and torch.allclose(by_server[scored], by_local[scored], atol=1e-5)
    assert (by_server[scored] != 0).all() and (by_local[~scored] == 0).all()

    # SGD: Adam's first step is lr * sign(gradient), where float noise in a near-zero gradient flips a sign
    after = []
    for logprobs in (by_local, by_server):
        model = load_student(tiny_student)[0]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        learn_on_batch(model, optimizer, batch | {"teacher_logprobs": logprobs}, CFG, torch.Generator().manual_seed(0))
        after.append(weights(model))
    assert all(torch.allclose(after[0][k], after[1][k], atol=1e-6) for k in after[0])
    assert any(not torch.equal(after[0][k], weights(load_student(tiny_student)[0])[k]) for k in after[0])


def test_tool_results_and_prompts_carry_no_kl(tiny_student, teacher):
    env = CalculatorEnv()  # the oracle's episodes as sampled: a random student makes no valid tool call
    tokenizer = load_student(tiny_student)[1]
    groups = make_groups(as_sampled(oracle_episodes(env, 3, 2), tokenizer, env.tools()), 2, tokenizer,
                         env.tools(), 256, 0, 0)
    batch = collate([s for g in groups for s in samples_of(g, [0.0] * len(g.rollouts))], tokenizer.pad_token_id)
    mask = batch["loss_mask"].bool()
    # the calculator's episodes have a tool result between assistant turns: tokens outside the mask after the
    # first assistant token of a row
    first = mask.float().argmax(-1)
    after_first = torch.arange(mask.shape[1]).unsqueeze(0) > first.unsqueeze(1)
    assert (after_first & ~mask & batch["attention_mask"].bool()).any(), "no tool result in the batch"
    batch, counts = with_teacher(batch, LocalTeacher(teacher, "cpu"))
    assert counts["teacher_tokens"] == int(mask.sum()) and counts["teacher_nonfinite_tokens"] == 0
    old = torch.randn(mask.shape)
    adv, _ = distill_advantages(old, batch["teacher_logprobs"], batch["loss_mask"], batch["advantages"], 1.0, 0.0)
    assert (adv[~mask] == 0).all() and (adv[mask] != 0).any()

    # changing the teacher's log-probabilities outside the mask changes nothing the learner does
    outside = batch["teacher_logprobs"].masked_fill(~mask, -50.0)
    after = []
    for logprobs in (batch["teacher_logprobs"], outside):
        model = load_student(tiny_student)[0]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        learn_on_batch(model, optimizer, batch | {"teacher_logprobs": logprobs}, CFG, torch.Generator().manual_seed(0))
        after.append(weights(model))
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])


@pytest.mark.parametrize("divergence", ["sampled", "forward"])
def test_an_opd_run_logs_the_kl_and_resumes_to_the_same_weights(tiny_student, teacher, tasks, tmp_path,
                                                                divergence):
    cfg = changed(CFG, {"teacher": str(teacher), "divergence": divergence}, steps=4, checkpoint_every=1)
    seen = []
    rows, summary = train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg,
                             tmp_path / "whole", checkpoint_dir=tmp_path / "whole-ck",
                             on_step=lambda s, m: seen.append(m))
    assert summary["updates"] > 0 and summary["teacher_tokens"] == summary["trained_tokens"] > 0
    assert all(m["teacher_tokens"] > 0 and m["teacher_kl"] == m["teacher_kl"] for m in seen)
    assert summary["teacher_kl_first"] == seen[0]["teacher_kl"] and summary["teacher_failed_groups"] == 0
    assert all(r["advantage"] is None and not r["dropped"] for r in rows)  # no reward advantage under `opd`
    if divergence == "forward":  # the exact KL is the loss's term, logged beside the sampled estimate
        assert all(m["teacher_divergence"] > 0 for m in seen)
        assert summary["teacher_divergence_first"] == seen[0]["teacher_divergence"]
    else:
        assert "teacher_divergence" not in seen[0]

    def stop(step, metrics):
        if step == 1:
            raise KeyboardInterrupt("killed")
    with pytest.raises(KeyboardInterrupt):
        train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg, tmp_path / "cut",
                 checkpoint_dir=tmp_path / "cut-ck", on_step=stop)
    resumed_rows, resumed = train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg,
                                     tmp_path / "cut", checkpoint_dir=tmp_path / "cut-ck")
    assert resumed["resumed_from_step"] == 2
    assert resumed_rows == rows
    a, b = weights(load_student(tmp_path / "cut")[0]), weights(load_student(tmp_path / "whole")[0])
    assert all(torch.equal(a[k], b[k]) for k in a)

    # another teacher is another run: its checkpoints are not resumed from
    other = changed(cfg, {"kl_coef": 0.5})
    with pytest.raises(KeyboardInterrupt):
        train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, other, tmp_path / "cut2",
                 checkpoint_dir=tmp_path / "cut2-ck", on_step=stop)
    _, fresh = train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, other, tmp_path / "cut2",
                        checkpoint_dir=tmp_path / "cut2-ck", teacher=LocalTeacher(tiny_student, "cpu"))
    assert fresh["resumed_from_step"] == 0


def test_reward_plus_opd_trains_groups_of_equal_rewards(tiny_student, teacher, tasks, tmp_path):
    cfg = changed(CFG, {"teacher": str(teacher)}, steps=2, objective="reward+opd")
    rows, summary = train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg, tmp_path / "rl")
    # the random student fails every task (equal rewards, no reward signal), yet every step learned
    assert {r["reward"] for r in rows} == {0.0}
    assert summary["skipped_groups"] == 0 and summary["updates"] == 2 * cfg.epochs_per_batch


def test_another_tokenizer_is_refused_naming_both(tiny_student, tmp_path, tasks):
    corpus = environment_corpus(CalculatorEnv(), n=300, seed=0)
    other = build_tiny_student(corpus, TinyModelConfig(hidden_size=32, layers=1, heads=2, vocab_size=350),
                               tmp_path / "other")
    cfg = changed(CFG, {"teacher": str(other)})
    with pytest.raises(OPDSetupError,
                       match=rf"{other}: its tokenizer \(350 tokens.*not the student's \({tiny_student}: 380 tokens"):
        train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg, tmp_path / "rl")
    assert not (tmp_path / "rl").exists()


def test_a_server_without_prompt_logprobs_is_refused_at_the_start(tiny_student, tasks, tmp_path):
    with OracleServer() as server:  # chat completions only, like a hosted API
        cfg = changed(CFG, {"teacher": "oracle", "base_url": server.url, "max_retries": 0})
        with pytest.raises(OPDSetupError, match=rf"teacher 'oracle' at {server.url}.*prompt_logprobs.*rl.opd"):
            train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg, tmp_path / "rl")
        assert not (tmp_path / "rl").exists()


def test_a_teacher_that_dies_mid_run_drops_that_steps_groups(tiny_student, teacher, tasks, tmp_path):
    with OracleServer(logprob_model=str(teacher)) as server:
        cfg = changed(CFG, {"teacher": "t", "base_url": server.url, "max_retries": 1})

        def die(step, metrics):  # step 0's sequences are answered, then the server drops every connection
            server.down_after = server.answers
        rows, summary = train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg,
                                 tmp_path / "rl", on_step=die)
    assert summary["teacher_failed_groups"] == 2 * CFG.tasks_per_step
    assert summary["updates"] == CFG.epochs_per_batch  # step 0 only; nothing trained on missing log-probs
    assert [r["dropped"] for r in rows] == [r["step"] > 0 for r in rows]


def test_nan_logprobs_are_masked_and_counted_then_an_error(tiny_student, teacher, tasks, tmp_path):
    with OracleServer(logprob_model=str(teacher)) as server:
        cfg = changed(CFG, {"teacher": "t", "base_url": server.url, "max_nonfinite_fraction": 0.5}, steps=1)
        server.inject("nan", "nan")  # the probe's (harmless there), then one sequence's: every log-prob null
        _, summary = train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks, cfg, tmp_path / "rl")
        assert 0 < summary["teacher_nonfinite_tokens"] < summary["teacher_tokens"] / 2
        assert summary["teacher_tokens"] == summary["trained_tokens"] + summary["teacher_nonfinite_tokens"]

        # every sequence of the step broken: far past the default 1%
        server.inject(*["nan"] * (1 + CFG.tasks_per_step * CFG.group_size))
        with pytest.raises(NonFiniteTeacher, match=r"NaN or infinite log-probabilities for \d+ of the \d+ .*0.01"):
            train_rl(tiny_student, Harness(CalculatorEnv(), Limits(max_turns=2)), tasks,
                     changed(cfg, {"max_nonfinite_fraction": 0.01}), tmp_path / "rl2")


def test_exact_divergences_by_hand():
    student_logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]], requires_grad=True)
    student = torch.log_softmax(student_logits, -1)
    teacher = torch.log(torch.tensor([[0.9, 0.1], [0.5, 0.5]]))
    forward = exact_divergence(student, teacher, "forward")
    assert forward[0].item() == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5))
    reverse = exact_divergence(student, teacher, "reverse")
    assert reverse[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    # the forward KL's gradient on the student's logits is p_student - p_teacher: the teacher's token pulled up
    forward.sum().backward()
    p = torch.softmax(student_logits.detach(), -1)
    assert torch.allclose(student_logits.grad, p - teacher.exp(), atol=1e-6)
    # a token the teacher rules out (-inf) leaves the reverse KL finite and large, the forward KL untouched
    ruled_out = torch.tensor([[0.0, -math.inf]])
    half = torch.log(torch.tensor([[0.5, 0.5]]))
    assert 40 < exact_divergence(half, ruled_out, "reverse").item() < 60
    assert exact_divergence(half, ruled_out, "forward").item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="output vocabularies differ"):
        exact_divergence(half, torch.zeros(1, 3), "forward")


@pytest.mark.parametrize("kind", ["reverse", "forward"])
def test_the_exact_divergence_is_taken_at_the_students_tokens_only(tiny_student, teacher, kind):
    """The learner's loss term against a plain forward pass of both models over whole rows (no shared
    opening, every position's logits): the mean over each row's student tokens, tool results left out."""
    env = CalculatorEnv()
    tokenizer = load_student(tiny_student)[1]
    groups = make_groups(as_sampled(oracle_episodes(env, 3, 2), tokenizer, env.tools()), 2, tokenizer,
                         env.tools(), 256, 0, 0)
    batch = collate([s for g in groups for s in samples_of(g, [0.0] * len(g.rollouts))], tokenizer.pad_token_id)
    batch, _ = with_teacher(batch, LocalTeacher(teacher, "cpu"))
    cfg = changed(CFG, {"divergence": kind}, epochs_per_batch=1, minibatch_size=64)
    student = load_student(tiny_student)[0]
    with torch.no_grad():
        logits = [load_student(path)[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                  for path in (tiny_student, teacher)]
    s, t = (torch.log_softmax(x[:, :-1].float(), -1) for x in logits)
    mask = batch["loss_mask"][:, 1:]
    per_token = exact_divergence(s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1]), kind).view(mask.shape)
    expected = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.5)
    stats = learn_on_batch(student, optimizer, batch, cfg, torch.Generator().manual_seed(0),
                           teacher=LocalTeacher(teacher, "cpu"))
    assert stats["teacher_divergence"] == pytest.approx(expected.item(), rel=1e-4)
    # and a step down it: the same batch is nearer the teacher after
    after = learn_on_batch(student, optimizer, batch, cfg, torch.Generator().manual_seed(0),
                           teacher=LocalTeacher(teacher, "cpu"))
    assert after["teacher_divergence"] < stats["teacher_divergence"]


def test_a_teacher_that_is_the_student_gives_no_exact_divergence(tiny_student, tasks):
    batch = _batch(tiny_student, tasks)
    itself = LocalTeacher(tiny_student, "cpu")
    batch, _ = with_teacher(batch, itself)
    cfg = changed(CFG, {"divergence": "reverse"})
    model = load_student(tiny_student)[0]
    stats = learn_on_batch(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, cfg,
                           torch.Generator().manual_seed(0), teacher=itself)
    assert stats["teacher_divergence"] == pytest.approx(0.0, abs=1e-6) and stats["teacher_kl"] == 0.0
    before = weights(load_student(tiny_student)[0])
    assert all(torch.allclose(weights(model)[k], before[k], atol=1e-6) for k in before)


def test_a_nan_teacher_row_leaves_the_exact_divergence_finite(tiny_student, teacher, tasks):
    """A teacher whose distribution is NaN at some of the student's tokens: those tokens leave the loss (counted),
    and the step stays finite."""
    class Broken(LocalTeacher):
        def logprobs(self, batch):
            out = super().logprobs(batch)
            out[0] = torch.nan
            return out

        def distributions(self, input_ids, attention_mask, wanted):
            out = super().distributions(input_ids, attention_mask, wanted)
            return out.masked_fill(torch.rand(out.shape[0], 1, generator=torch.Generator().manual_seed(0)) < 0.3,
                                   math.nan)

    broken = Broken(teacher, "cpu")
    batch, counts = with_teacher(_batch(tiny_student, tasks), broken)
    assert counts["teacher_nonfinite_tokens"] > 0
    cfg = changed(CFG, {"divergence": "forward"})
    model = load_student(tiny_student)[0]
    stats = learn_on_batch(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, cfg,
                           torch.Generator().manual_seed(0), teacher=broken)
    assert math.isfinite(stats["teacher_divergence"]) and math.isfinite(stats["loss"])
    assert all(torch.isfinite(w).all() for w in weights(model).values())


def test_opd_config_errors():
    with pytest.raises(ValidationError, match="objective 'opd' needs rl.opd with a teacher"):
        RLConfig(objective="opd")
    with pytest.raises(ValidationError, match="group_size 1: objective 'reward'"):
        RLConfig(group_size=1)
    assert RLConfig(group_size=1, objective="opd", opd={"teacher": "models/t"}).objective.opd.kl_coef == 1.0
    # the whole distribution comes only from a local checkpoint
    with pytest.raises(ValidationError, match="divergence 'forward' takes the teacher's whole distribution"):
        OPDConfig(teacher="Qwen/Qwen3-8B", base_url="http://localhost:8000/v1", divergence="forward")
    assert OPDConfig(teacher="models/t").divergence == "sampled"
