"""What a member's KV pool and decode batch default to: what its device holds.

On the CPU the defaults are fixed numbers (the pool a few hundred MB, 64 sequences a
step). On CUDA a member may fill a fraction of the device's *total* memory with its
weights and its pool, like vLLM's ``--gpu-memory-utilization``; `pdmesh up` gives each
member on a GPU its share of the mesh's fraction, so a prefill and a decode on one card
size themselves from their own shares, whichever of them starts first. A share is only
a ceiling: a member never plans past the memory free when it sizes its pool, and it
leaves a reserve outside the pool for what it allocates later (activations, sampling
buffers, CUDA graph buckets) and for what torch does not count (the CUDA context, NIXL).

Nothing here allocates: `kv_pages_that_fit` is a pure function of the memory figures, so
the rule is tested without a GPU; `device_memory` reads the figures on a real one.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
DEFAULT_GPU_MEMORY_FRACTION = 0.85  # of each GPU, for the whole mesh (pdmesh up)
RESERVE_BYTES = 1 * GIB  # per member, outside the pool: activations, graphs, context, NIXL
CPU_KV_PAGES = {"prefill": 512, "decode": 2048}
CPU_MAX_BATCH = 64
CUDA_MAX_BATCH = 256
# Prompt tokens per prefill chunk and per packed forward pass. On 2 CPU cores a pass is
# compute-bound and its pack attention quadratic, so packs stay small. On a GPU a pass is
# bound by the host launching its kernels (a 312-token SmolLM2-shaped prompt: about 28 ms
# of host time for 3.5 ms of GPU work on an H100), so fewer, larger passes cut TTFT.
CPU_PREFILL = (256, 512)  # (chunk tokens, pack tokens)
CUDA_PREFILL = (512, 2048)


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def cuda_index(device: str) -> int | None:
    """The GPU index of a CUDA device ("cuda" is 0), None for the CPU."""
    if not is_cuda(device):
        return None
    return int(device.removeprefix("cuda").removeprefix(":") or "0")


def default_max_batch(device: str) -> int:
    """Sequences per decode step: a GPU step costs about the same at 1 and at 256."""
    return CUDA_MAX_BATCH if is_cuda(device) else CPU_MAX_BATCH


def default_prefill_tokens(device: str) -> tuple[int, int]:
    """(chunk tokens, pack tokens) a prefill uses on ``device`` unless told otherwise."""
    return CUDA_PREFILL if is_cuda(device) else CPU_PREFILL


def check_device(device: str) -> str | None:
    """Why ``device`` cannot run a member on this machine, or None.

    Imports torch only for a CUDA device, so `pdmesh up --device cpu` stays fast."""
    if device == "cpu":
        return None
    if not is_cuda(device):
        return f"{device!r} is not a device: use cpu, cuda or cuda:N"
    index_text = device.removeprefix("cuda").removeprefix(":") or "0"
    if not index_text.isdigit():
        return f"{device!r} is not a device: use cpu, cuda or cuda:N"
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none: a CPU-only build"
        return f"no CUDA device is visible here (torch {torch.__version__}, CUDA {build})"
    count = torch.cuda.device_count()
    if int(index_text) >= count:
        return f"{device} does not exist: this machine has {count} CUDA device(s)"
    return None


def memory_fraction(text: str) -> float:
    """An argparse type: a fraction in (0, 1]."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as a member sees it when it sizes its pool (bytes)."""

    free: int  # free on the device now (every process's use subtracted)
    total: int
    used_here: int  # held by this process already: its weights


def kv_pages_that_fit(
    memory: DeviceMemory, fraction: float, bytes_per_page: int, max_pages: int,
    reserve: int = RESERVE_BYTES,
) -> int:
    """KV pages for a member allowed ``fraction`` of the device's total memory.

    The budget is that share less what the member already holds and its reserve, and
    never more than what is free now less the reserve (another process may hold more
    than its share). ``max_pages`` caps it at what the member's rooms could ever use:
    pages no request can reach are memory taken from everyone else."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
    share = int(fraction * memory.total) - memory.used_here
    budget = min(share, memory.free - reserve) - reserve
    return max(0, min(max_pages, budget // bytes_per_page))


def device_memory(device: str) -> DeviceMemory:
    """The figures of a CUDA device, read after the weights were loaded."""
    import torch

    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    return DeviceMemory(free=free, total=total, used_here=torch.cuda.memory_reserved(dev))


def describe(pages: int, page_tokens: int, bytes_per_page: int) -> str:
    """'94,208 pages (1,507,328 tokens, 33.1 GiB)' for the start-up log and messages."""
    return (f"{pages:,} pages ({pages * page_tokens:,} tokens, "
            f"{pages * bytes_per_page / GIB:.2f} GiB)")
