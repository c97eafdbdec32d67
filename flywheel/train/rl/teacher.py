"""The teacher of on-policy distillation: its log-probability of every token the student sampled.

Two kinds, one method (`logprobs`: a collated batch in, [B, T] out, aligned with token_logprobs'):
- a local checkpoint (LocalTeacher), run by the learner on `rl.opd.device`;
- a server over the OpenAI protocol (ServerTeacher) whose completions API returns prompt log-probabilities
  (vLLM: `prompt` as token ids, `prompt_logprobs`), asked with the student's token ids, so no text is
  re-tokenised on the way.

Both are checked before the first step (`check`): the tokenizer must be the student's, token for token, since
a log-probability of another vocabulary's token ids means nothing; a server must answer with prompt
log-probabilities at all. Either failure is an OPDSetupError naming the teacher and the option. A server that
fails mid-run, past its client's retries, raises TeacherUnavailable: the learner drops the step's groups.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from flywheel.config import OPDConfig
from flywheel.errors import UserFacingError

# Text whose token ids are sent to the teacher at the start: the tokenizers must agree on every id of it.
PROBE = "Check 12 + 345 = 357, then answer: {\"name\": \"calculator\"}."


class OPDSetupError(UserFacingError, ValueError):
    """The teacher cannot serve on-policy distillation: missing, another tokenizer, or no log-probabilities."""


class TeacherUnavailable(RuntimeError):
    """The teacher failed past its retries on one step's batch: that step's groups are dropped, not trained."""


class LocalTeacher:
    """A checkpoint folder loaded once, in the learner's process, on `device`."""

    def __init__(self, path: str | Path, device: str = "auto", chunk: int = 32):
        from flywheel.checkpoints import CheckpointError, load_student
        from flywheel.devices import resolve_device

        self.path = Path(path)
        self.name = f"teacher checkpoint {self.path}"
        self.chunk = chunk
        self.device = resolve_device(device, "rl.opd.device (the teacher)")
        try:
            self.model, self.tokenizer = load_student(self.path)
        except CheckpointError as err:
            raise OPDSetupError(f"rl.opd.teacher: {err}") from err
        self.model.to(self.device)
        self.model.eval()

    def check(self, student_tokenizer, student: str = "the student") -> None:
        """OPDSetupError unless the teacher's tokenizer is the student's (the same ids for the same tokens)."""
        ours, theirs = student_tokenizer.get_vocab(), self.tokenizer.get_vocab()
        if ours != theirs or student_tokenizer.eos_token_id != self.tokenizer.eos_token_id:
            differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
            raise OPDSetupError(
                f"rl.opd.teacher {self.path}: its tokenizer ({len(theirs)} tokens, {type(self.tokenizer).__name__}) "
                f"is not the student's ({student}: {len(ours)} tokens, {type(student_tokenizer).__name__}); "
                f"e.g. {differ or 'the end token differs'}. On-policy distillation compares the two models' "
                "log-probabilities of the same token ids, so the teacher must share the student's tokenizer "
                "(no cross-tokenizer alignment is implemented)")

    def identity(self) -> str:
        """The checkpoint's bytes: a different teacher is a different run (checkpoints, cache keys)."""
        digest = hashlib.sha256()
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(self.path)).encode())
            digest.update(file.read_bytes())
        return digest.hexdigest()

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """log p_teacher(token t | tokens before t) at the batch's loss-mask positions, [B, T]; 0 elsewhere. Where
        the student sampled under a token mask (constrained decoding), the teacher's distribution under the same
        mask: the two policies compared as the harness runs them."""
        from flywheel.train.rl.loss import TokenMasks, token_logprobs

        ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"] > 0
        masks, n = TokenMasks.of(batch), len(ids)
        parts = [token_logprobs(self.model, ids[i:i + self.chunk].to(self.device),
                                attention[i:i + self.chunk].to(self.device),
                                wanted=mask[i:i + self.chunk].to(self.device),
                                masks=masks and masks.select(slice(i, i + self.chunk), n)).cpu()
                 for i in range(0, n, self.chunk)]
        return torch.cat(parts)

    @torch.no_grad()
    def distributions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      wanted: torch.Tensor, masks=None) -> torch.Tensor:
        """The teacher's whole next-token log-distribution at each wanted token, [N, V] in the row-major order
        of `wanted` (rl.opd.divergence reverse or forward), on the device the ids came from; under the student's
        token masks where given (flywheel.train.rl.loss.TokenMasks: -inf where disallowed)."""
        from flywheel.train.rl.loss import token_distributions

        return token_distributions(self.model, input_ids.to(self.device), attention_mask.to(self.device),
                                   wanted.to(self.device), masks=masks)[1].to(input_ids.device)

    def close(self) -> None:
        """Nothing held but memory."""


class ServerTeacher:
    """A model served over the OpenAI protocol with prompt log-probabilities (vLLM's completions API)."""

    def __init__(self, cfg: OPDConfig):
        from flywheel.policies.openai import OpenAIPolicy

        self.cfg = cfg
        self.client = OpenAIPolicy.from_endpoint(cfg, model=cfg.teacher)
        self.name = f"teacher '{cfg.teacher}' at {self.client.endpoint}"

    def _ask(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's prompt log-probabilities (its first token: 0), in order; TeacherError past retries."""
        bodies = {str(i): {"model": self.cfg.teacher, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                           "prompt_logprobs": 1}
                  for i, ids in enumerate(sequences)}
        answers = self.client.post_many(bodies, "completions")
        return [_prompt_logprobs(answers[str(i)]["response"], ids, self.name)
                for i, ids in enumerate(sequences)]

    def check(self, student_tokenizer, student: str = "the student") -> None:
        """OPDSetupError unless the server answers a probe with prompt log-probabilities of the student's ids."""
        from flywheel.policies.openai import TeacherError

        ids = student_tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        try:
            response = self.client.post_many({"probe": {"model": self.cfg.teacher, "prompt": ids, "max_tokens": 1,
                                                        "temperature": 1.0, "prompt_logprobs": 1}},
                                             "completions")["probe"]["response"]
        except TeacherError as err:
            raise OPDSetupError(f"rl.opd: {self.name} did not answer a prompt_logprobs request (rl.opd.base_url, "
                                f"rl.opd.teacher): {err}") from err
        entries = (response.get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise OPDSetupError(
                f"rl.opd: {self.name} answered a completions request without prompt log-probabilities "
                f"({'none' if entries is None else f'{len(entries)} for {len(ids)} tokens'}); on-policy distillation "
                "needs a server that returns them (vLLM's OpenAI server does: `prompt_logprobs`), or a local "
                "checkpoint as rl.opd.teacher without rl.opd.base_url")
        for position, (token, entry) in enumerate(zip(ids[1:], entries[1:], strict=True), start=1):
            decoded = (entry or {}).get(str(token), {}).get("decoded_token")
            expected = student_tokenizer.decode([token])
            if decoded is not None and decoded != expected:
                raise OPDSetupError(
                    f"rl.opd: {self.name} reads the student's token id {token} (position {position} of a probe) "
                    f"as {decoded!r}, the student's tokenizer ({student}) as {expected!r}: the served model's "
                    "tokenizer is not the student's, and on-policy distillation compares log-probabilities of the "
                    "same ids (no cross-tokenizer alignment is implemented)")
        _prompt_logprobs(response, ids, self.name)

    def identity(self) -> str:
        return f"{self.client.endpoint}|{self.cfg.teacher}"

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from flywheel.policies.openai import TeacherError

        lengths = batch["attention_mask"].sum(-1).tolist()
        sequences = [row[:n].tolist() for row, n in zip(batch["input_ids"], lengths, strict=True)]
        try:
            answers = self._ask(sequences)
        except TeacherError as err:
            raise TeacherUnavailable(str(err)) from err
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for row, values in enumerate(answers):
            out[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        return out

    def close(self) -> None:
        self.client.close()


def _prompt_logprobs(response: dict, ids: list[int], name: str) -> list[float]:
    """The log-probability of each prompt token as the server scored it (the first token has none: 0)."""
    entries = (response.get("choices") or [{}])[0].get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise OPDSetupError(f"rl.opd: {name} returned {'no' if entries is None else len(entries)} prompt "
                            f"log-probabilities for {len(ids)} tokens")
    values = [0.0]
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        picked = (entry or {}).get(str(token))
        values.append(float(picked["logprob"]) if isinstance(picked, dict) and picked.get("logprob") is not None
                      else math.nan)  # an answer without the token's log-probability: masked and counted
    return values


def load_teacher(cfg: OPDConfig, root: str | Path = ".") -> LocalTeacher | ServerTeacher:
    """The teacher rl.opd names: a server when base_url is set, else a checkpoint folder under root."""
    if cfg.base_url:
        return ServerTeacher(cfg)
    path = Path(cfg.teacher)
    return LocalTeacher(path if path.is_absolute() else Path(root) / path, cfg.device)
