"""Where a model runs: the `device` settings of pipelines.yaml (`auto`, `cpu`, `cuda`, `cuda:N`) made concrete.

`auto` is a CUDA GPU when one is visible, else the CPU. A setting that names a GPU the machine does not have is
an error naming the setting, never a silent fall back to the CPU (a run planned for a GPU would take hours).
"""

from __future__ import annotations

import os

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"  # what flywheel.config accepts for every device setting


def resolve_device(setting: str, what: str = "device") -> str:
    """`cpu`, `cuda` or `cuda:N` for the setting; raises naming `what` when the GPU it asks for is not there."""
    import torch

    if setting == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if setting == "auto":
        return "cuda" if available else "cpu"
    if not setting.startswith("cuda"):
        raise ValueError(f"{what}: {setting!r} is not a device (use auto, cpu, cuda or cuda:N)")
    if not available:
        raise RuntimeError(f"{what}: {setting!r} but no CUDA GPU is visible on this machine (torch "
                           f"{torch.__version__}); use auto or cpu")
    index = gpu_index(setting)
    if index is not None and index >= torch.cuda.device_count():
        raise RuntimeError(f"{what}: {setting!r} but this machine shows {torch.cuda.device_count()} CUDA GPU(s) "
                           f"(indexes 0..{torch.cuda.device_count() - 1})")
    return setting


def gpu_index(device: str) -> int | None:
    """N of `cuda:N`; None for `cuda` (the current GPU) and for the CPU."""
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


def actor_device(student_device: str, actor_devices: list[str], actor: int) -> str:
    """The device setting of RL actor `actor`: its own entry of rl.actor_devices, else the student's."""
    return actor_devices[actor] if actor_devices else student_device


def pin_visible_gpu(device: str, what: str = "device") -> None:
    """Make `cuda:N` the only GPU this process (and the engines it starts) sees, before CUDA starts here.

    vLLM places its engine on "the" GPU of the process, so a GPU index is honoured through CUDA_VISIBLE_DEVICES.
    CUDA reads the variable once, at the first device query of the process: call this before anything asks
    (torch.cuda.is_available() included). Once torch has started CUDA here it is an error, not a no-op.
    """
    index = gpu_index(device)
    if index is None:
        return
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(f"{what}: {device!r} needs its GPU chosen before CUDA starts in this process; run it "
                           f"in a process of its own, or set CUDA_VISIBLE_DEVICES={index} and use 'cuda'")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    if ids is not None and index >= len(ids):
        raise RuntimeError(f"{what}: {device!r} but CUDA_VISIBLE_DEVICES={visible} shows {len(ids)} GPU(s)")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index] if ids is not None else str(index)


def native_bf16(setting: str = "auto") -> bool:
    """Whether bfloat16 runs natively where `setting` places a model: a CUDA GPU that supports it, or a CPU with
    AVX-512 BF16 or AMX (/proc/cpuinfo's flags). Elsewhere bf16 is emulated and slower than fp32."""
    if setting != "cpu":
        import torch

        if torch.cuda.is_available():
            return bool(torch.cuda.is_bf16_supported())
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:  # not Linux: no way to tell here; fp32 is never the slow choice
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})
