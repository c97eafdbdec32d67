"""On-policy distillation: the teacher's per-token judgement of the student's own samples as the advantage.

The student samples episodes as in RL; the teacher scores every token the student wrote; each assistant token
gets the advantage -kl_coef * (log p_student - log p_teacher), the sampled estimate of the reverse KL
KL(student || teacher) at that token, negated (plus reward_coef times the group's reward advantage under
`reward+opd`). The learner takes its usual clipped, importance-corrected steps on these per-token advantages,
so tokens the teacher finds likelier than the student are pushed up, the others down. Only tokens in the loss
mask (the student's own) get one: prompts and tool results carry no KL.

With a local teacher the divergence can instead be exact (`rl.opd.divergence: reverse | forward`): at each
position the student wrote, the KL between the two models' whole next-token distributions, KL(student ||
teacher) or KL(teacher || student), times kl_coef, is a loss term beside the policy loss (which then carries
only the reward advantages of `reward+opd`). The sampled advantage is a one-token estimate of the reverse KL's
gradient: it pushes down the token drawn and leaves the teacher's own choice to rise only as the rest do; the
exact forms move every token of the vocabulary at once, and `forward` pulls the teacher's token up directly,
most where the student gives it least (a student that never learned to copy a big number hardly ever samples
the copy, so the sampled signal rarely reaches it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flywheel.config import OPDConfig
from flywheel.errors import UserFacingError


class NonFiniteTeacher(UserFacingError, RuntimeError):
    """Too many of the teacher's log-probabilities were NaN or infinite (past rl.opd.max_nonfinite_fraction)."""


def distill_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                       reward_advantages: torch.Tensor, kl_coef: float,
                       reward_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages [B, T] and their stats: teacher_kl, the mean sampled reverse KL over masked tokens.

    old_logprobs: the student's (the policy the ratio is taken against); reward_advantages [B]: the group
    advantages of the task reward (0 under `opd`). Tokens outside the mask get 0.
    """
    mask = mask.to(old_logprobs.dtype)
    reverse_kl = (old_logprobs - teacher_logprobs) * mask
    advantages = (-kl_coef * reverse_kl + reward_coef * reward_advantages.to(old_logprobs.dtype).unsqueeze(-1)) * mask
    tokens = mask.sum().clamp(min=1.0)
    return advantages.detach(), {"teacher_kl": float(reverse_kl.sum() / tokens),
                                 "teacher_logprob": float((teacher_logprobs * mask).sum() / tokens)}


def exact_divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL between two log-distributions [N, V] (the student's carries the gradient): `reverse`
    KL(student || teacher), `forward` KL(teacher || student); [N], each >= 0. A teacher's -inf (probability 0)
    is read as e^-100, so the reverse KL stays finite where the student still gives such a token mass. A token
    the student's own -inf rules out (a token mask of constrained decoding, which the teacher's distributions
    share) adds nothing to either."""
    if student.shape != teacher.shape:
        raise ValueError(f"the student's distributions are {tuple(student.shape)} and the teacher's "
                         f"{tuple(teacher.shape)}: the two models' output vocabularies differ")
    if kind not in ("reverse", "forward"):
        raise ValueError(f"unknown divergence '{kind}' (exact ones: reverse, forward)")
    ruled_out = student == float("-inf")
    # finite stand-ins where ruled out, so neither the sum nor its gradient meets 0 * inf
    student = student.masked_fill(ruled_out, 0.0)
    teacher = teacher.detach().clamp(min=-100.0).masked_fill(ruled_out, 0.0)
    term = student.exp() * (student - teacher) if kind == "reverse" else teacher.exp() * (teacher - student)
    return term.masked_fill(ruled_out, 0.0).sum(-1)


def with_teacher(batch: dict[str, torch.Tensor], teacher) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The batch with `teacher_logprobs`; a token whose teacher log-probability is NaN or infinite leaves the
    loss mask. Returns (batch, counts: teacher_tokens, teacher_nonfinite_tokens, both within the loss mask).
    TeacherUnavailable (from the teacher) passes up: the caller drops the step's groups."""
    logprobs = teacher.logprobs(batch)
    if logprobs.shape != batch["input_ids"].shape:
        raise ValueError(f"{teacher.name} returned log-probabilities of shape {tuple(logprobs.shape)} for a batch "
                         f"of {tuple(batch['input_ids'].shape)}")
    mask = batch["loss_mask"] > 0
    bad = mask & ~torch.isfinite(logprobs)
    counts = {"teacher_tokens": int(mask.sum()), "teacher_nonfinite_tokens": int(bad.sum())}
    loss_mask = batch["loss_mask"].masked_fill(bad, 0.0)
    return batch | {"teacher_logprobs": torch.nan_to_num(logprobs.float(), nan=0.0, posinf=0.0, neginf=0.0),
                    "loss_mask": loss_mask}, counts


@dataclass
class NonFiniteBudget:
    """The run's count of NaN or infinite teacher log-probabilities against rl.opd.max_nonfinite_fraction."""

    limit: float
    name: str
    tokens: int = 0
    nonfinite: int = 0

    @classmethod
    def of(cls, opd: OPDConfig, name: str, history: list[dict]) -> NonFiniteBudget:
        """The budget so far (a resumed run's steps count)."""
        budget = cls(opd.max_nonfinite_fraction, name)
        for metrics in history:
            budget.tokens += int(metrics.get("teacher_tokens", 0))
            budget.nonfinite += int(metrics.get("teacher_nonfinite_tokens", 0))
        return budget

    def add(self, tokens: int, nonfinite: int, step: int) -> None:
        """Count one step's; NonFiniteTeacher once the run's share is past the limit."""
        self.tokens += tokens
        self.nonfinite += nonfinite
        if self.nonfinite and self.nonfinite > self.limit * self.tokens:
            raise NonFiniteTeacher(
                f"{self.name} gave NaN or infinite log-probabilities for {self.nonfinite} of the {self.tokens} "
                f"student tokens scored by step {step} ({self.nonfinite / self.tokens:.1%}; "
                f"rl.opd.max_nonfinite_fraction {self.limit:g}): such tokens are left out of the loss, but this "
                "many mean the teacher is broken (check its weights and dtype)")
