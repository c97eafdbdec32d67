"""The `vllm` policy: an in-process vLLM engine on a GPU, with token ids and sampling logprobs.

GPU hosts only: vllm is imported when the policy is built, never at import time, and nothing on the CPU path
needs it (pyproject's `gpu` extra; a GPU host installs with its own pins, see NOTES). Untested on the CPU-only
machines this project is developed on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flywheel.policies.base import Completion, Sampling
from flywheel.policies.cache import sample_indexes
from flywheel.policies.toolcalls import parse_completion


class VLLMPolicy:
    """Batched chat generation with vllm.LLM; tool calls parsed from `<tool_call>` text like the hf policy.

    Not constrained: Sampling.tool_choice and Sampling.constrained are accepted and not applied here (vLLM's
    structured outputs take a JSON schema or grammar for the whole answer, and its names changed across the
    versions this project allows; untested without a GPU). What it writes is held to tool_choice after the fact:
    by the server (resampled, or a 422, see flywheel/serving/chat.py) and by the harness (an error turn)."""

    name = "vllm"

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, seed: int = 0, engine_args: dict | None = None,
                 device: str = "auto"):
        """The engine on `device`: auto or cuda (the process's GPU), or cuda:N (made the only GPU it sees)."""
        from flywheel.devices import gpu_index, pin_visible_gpu, resolve_device

        where = f"vllm policy for {model}"
        if device != "cpu":
            pin_visible_gpu(device, where)  # first: CUDA reads CUDA_VISIBLE_DEVICES once, at its first query
            device = "cuda" if gpu_index(device) is not None else device  # now the only GPU visible
        if device == "cpu" or resolve_device(device, where) == "cpu":
            raise RuntimeError(f"{where}: vLLM runs on a CUDA GPU only and none is visible here (use the hf "
                               "policy on the CPU, or openai against a vLLM server)")
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError("the vllm policy needs vLLM on a GPU host (pip install '.[gpu]' with the GPU "
                              "pins); on CPU use the openai policy against a vLLM server, or hf") from err
        self.model = model
        self.llm = LLM(model=model, tensor_parallel_size=tensor_parallel_size,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, seed=seed,
                       **(engine_args or {}))

    def load_weights(self, state_dict) -> None:
        """Push an RL learner's published weights into the running engine (no restart), as TRL's colocate mode.

        Needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); the prefix cache is reset because
        cached keys and values were computed by the old weights.
        """
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(list(state_dict.items()))
        self.llm.reset_prefix_cache()

    def generate(self, conversations: Sequence[list[dict]], tools: list[dict], sampling: Sampling,
                 samples: Sequence[int] | None = None) -> list[Completion]:
        """One completion per conversation; identical conversations get distinct seeds (see sample_indexes)."""
        from vllm import SamplingParams

        samples = list(samples) if samples is not None else sample_indexes(conversations)
        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, logprobs=0,
                                 seed=None if sampling.seed is None else sampling.seed + sample)
                  for sample in samples]
        started = time.perf_counter()
        outputs = self.llm.chat([list(c) for c in conversations], sampling_params=params, tools=tools or None,
                                use_tqdm=False)
        elapsed = time.perf_counter() - started
        completions = []
        for output in outputs:
            generated = output.outputs[0]
            ids = list(generated.token_ids)
            completion = parse_completion(generated.text)
            completion.token_ids = ids
            if generated.logprobs:  # one {token id: Logprob} per step; the sampled token is always in it
                completion.logprobs = [step[token].logprob for step, token in zip(generated.logprobs, ids, strict=True)]
            completion.usage = {"prompt_tokens": len(output.prompt_token_ids or []), "completion_tokens": len(ids)}
            # one engine call serves the whole batch: each turn is charged its share of it, as the hf policy does
            completion.latency_s = elapsed / len(outputs)
            completions.append(completion)
        return completions
