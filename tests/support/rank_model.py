"""A model rank with vLLM-style parameters and weight loaders, for plan_loads() and load_targets().

RankModel is rank `rank` of `ranks` of a small model whose load_weights does what vLLM's weight
loaders do (narrow to a rank's part, copy into a block of a fused parameter, fill a padded
vocabulary), plus loaders that do more than that (a transpose, arithmetic, a read of the values,
replacing a parameter's memory, two parts of one tensor), which plan_loads() must leave to the
loader (FALLBACK, and "halves"). Used by tests/client/test_loader_plan.py and, on a GPU,
benchmarks/cuda_plan_load.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# The default sizes: vocabulary HIDDEN + 2, padded to HIDDEN + 4.
HIDDEN = 8


class RankModel(nn.Module):
    """Rank `rank` of `ranks` of a small model with vLLM-style parameters and loaders, on device.

    hidden (a multiple of ranks) sets every size; the vocabulary is hidden + 2 rows, padded to hidden + 4.
    """

    def __init__(self, rank: int, ranks: int, hidden: int = HIDDEN, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.rank, self.ranks, self.hidden = rank, ranks, hidden
        padded = hidden + 4
        part = padded // ranks
        self.embed = nn.Parameter(torch.full((part, hidden), -1.0))  # padded vocabulary, split by rows
        self.qkv = nn.Parameter(torch.full((3 * hidden // ranks, hidden), -1.0))  # fused, column-parallel
        self.down = nn.Parameter(torch.full((hidden, hidden // ranks), -1.0))  # row-parallel
        self.norm = nn.Parameter(torch.full((hidden,), -1.0))  # replicated
        self.mixed = nn.Parameter(torch.full((hidden, hidden), -1.0))  # loaded by a transpose
        self.scaled = nn.Parameter(torch.full((hidden,), -1.0))  # loaded by arithmetic
        self.scalar = nn.Parameter(torch.full((1,), -1.0))  # loaded by .item()
        self.replaced = nn.Parameter(torch.full((4,), -1.0))  # loaded by param.data = ...
        self.halves = nn.Parameter(torch.full((2, hidden // ranks), -1.0))  # two parts of one tensor
        self.to(device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        r, n = self.rank, self.ranks
        hidden, vocab, padded = self.hidden, self.hidden + 2, self.hidden + 4
        for name, w in weights:
            if name == "lm_head":  # tied: the embedding serves
                continue
            if name == "embed":
                part = padded // n
                start = r * part
                rows = max(0, min(part, vocab - start))
                self.embed.data[:rows].copy_(w.narrow(0, start, rows))
                self.embed.data[rows:].fill_(0)
                loaded.add("embed")
            elif name in ("q", "k", "v"):
                block = hidden // n
                at = "qkv".index(name) * block
                self.qkv.data.narrow(0, at, block).copy_(w.narrow(0, r * block, block))
                loaded.add("qkv")
            elif name == "down":
                self.down.data.copy_(w.narrow(1, r * hidden // n, hidden // n))
                loaded.add("down")
            elif name == "norm":
                self.norm.data.copy_(w)
                loaded.add("norm")
            elif name == "mixed":
                self.mixed.data.copy_(w.t())
                loaded.add("mixed")
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)
                loaded.add("scaled")
            elif name == "scalar":
                self.scalar.data.fill_(w.item())
                loaded.add("scalar")
            elif name == "replaced":
                self.replaced.data = torch.zeros(4, device=self.replaced.device)
                self.replaced.data.copy_(w)
                loaded.add("replaced")
            elif name == "halves":
                width = hidden // n
                # A fused gate_up checkpoint tensor: this rank's part of each half.
                self.halves.data[0].copy_(w.narrow(0, r * width, width))
                self.halves.data[1].copy_(w.narrow(0, hidden + r * width, width))
                loaded.add("halves")
            else:
                raise KeyError(name)
        return loaded


FALLBACK = {"mixed", "scaled", "scalar", "replaced"}


def rank_checkpoint(dtype: torch.dtype, hidden: int = HIDDEN, seed: int = 7) -> dict[str, torch.Tensor]:
    """The checkpoint RankModel loads, in dtype."""
    vocab = hidden + 2
    torch.manual_seed(seed)
    state = {
        "embed": torch.randn(vocab, hidden),
        "lm_head": torch.randn(vocab, hidden),
        "q": torch.randn(hidden, hidden),
        "k": torch.randn(hidden, hidden),
        "v": torch.randn(hidden, hidden),
        "down": torch.randn(hidden, hidden),
        "norm": torch.randn(hidden),
        "mixed": torch.randn(hidden, hidden),
        "scaled": torch.randn(hidden),
        "scalar": torch.randn(1),
        "replaced": torch.randn(4),
        "halves": torch.randn(2 * hidden),
    }
    return {name: t.to(dtype) for name, t in state.items()}
