"""Progress bars for loads: bytes received, shown on rank 0 only."""

from __future__ import annotations

from tqdm import tqdm

from weightstream.client.options import ClientOptions

# Plain enough to survive log prefixes, the way vLLM's loaders draw theirs.
BAR_FORMAT = "{desc}: {percentage:3.0f}% | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def is_rank_zero(options: ClientOptions | None = None) -> bool:
    """True unless this process is a non-zero rank of a distributed job (RANK, LOCAL_RANK, torch.distributed).

    options: what the environment says (default: read it now).
    """
    if options is None:
        options = ClientOptions.from_environ()
    if not options.rank_zero:
        return False
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except (ImportError, RuntimeError):
        pass
    return True


def byte_bar(total: int, description: str, enabled: bool) -> tqdm:
    """A bar counting bytes towards total; drawn only when enabled (the caller asks is_rank_zero)."""
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        mininterval=0.5,
        bar_format=BAR_FORMAT,
        disable=not enabled,
        leave=True,
    )
