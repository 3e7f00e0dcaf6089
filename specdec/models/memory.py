"""How much memory an allocation can take where it goes: the accelerator's free memory, or the host's."""

from __future__ import annotations

from pathlib import Path


def accelerator_free_bytes(framework: str, device=None) -> int | None:
    """Free memory of the accelerator an engine of `framework` allocates on (torch: `device`, by default the current
    CUDA device; JAX: its first device); None on a CPU."""
    if framework == "torch":
        import torch

        if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
            return None
        return torch.cuda.mem_get_info(device)[0]
    import jax

    first = jax.devices()[0]
    stats = first.memory_stats() if first.platform != "cpu" else None
    return stats["bytes_limit"] - stats["bytes_in_use"] if stats else None


def host_available_bytes() -> int | None:
    """The host memory a new allocation can take without swapping (/proc/meminfo's MemAvailable); None where the
    system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_bytes(framework: str, device=None) -> int | None:
    """Where an engine's allocation goes: the accelerator's free memory, else the host's."""
    free = accelerator_free_bytes(framework, device)
    return host_available_bytes() if free is None else free
