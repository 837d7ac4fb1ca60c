"""Progress bars for loads: bytes received, shown on rank 0 only."""

from __future__ import annotations

import os

from tqdm import tqdm

# Plain enough to survive log prefixes, the way vLLM's loaders draw theirs.
BAR_FORMAT = "{desc}: {percentage:3.0f}% | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def is_rank_zero() -> bool:
    """True unless this process is a non-zero rank of a distributed job (RANK, LOCAL_RANK, torch.distributed)."""
    for variable in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(variable)
        if value not in (None, "") and value != "0":
            return False
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except (ImportError, RuntimeError):
        pass
    return True


def byte_bar(total: int, description: str, enabled: bool) -> tqdm:
    """A bar counting bytes towards total; disabled unless enabled and on rank 0."""
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        mininterval=0.5,
        bar_format=BAR_FORMAT,
        disable=not (enabled and is_rank_zero()),
        leave=True,
    )
