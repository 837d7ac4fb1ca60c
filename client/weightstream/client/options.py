"""The client's settings from the environment: every variable it reads, read here and nowhere else.

An explicit argument (WeightStreamClient's token and shm_dir, the vLLM loader's extra config)
always wins over the environment; the environment only fills what was not passed. A client reads
it once, when it is made.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# A bearer token, when none is passed (a pod mounts one as a variable).
TOKEN_ENV = "WEIGHTSTREAM_TOKEN"
# The shared-memory directory the server also sees, when none is passed (a pod sets it once).
SHM_DIR_ENV = "WEIGHTSTREAM_SHM_DIR"
# The vLLM loader's server address and model id, when its extra config names none.
TARGET_ENV = "WEIGHTSTREAM_TARGET"
MODEL_ENV = "WEIGHTSTREAM_MODEL"
# Set by distributed launchers (torchrun, vLLM's workers): a non-zero rank draws no progress bar.
RANK_VARIABLES = ("RANK", "LOCAL_RANK")


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """What the environment says about the client; None where it says nothing."""

    token: str | None = None
    shm_dir: Path | None = None
    target: str | None = None
    model: str | None = None
    # The values of RANK and LOCAL_RANK that are set (not empty), as the launcher wrote them.
    ranks: tuple[str, ...] = ()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ClientOptions:
        """The options environ (default: this process's environment) sets."""
        env = os.environ if environ is None else environ
        shm_dir = env.get(SHM_DIR_ENV)
        return cls(
            # A token read from a file or a variable often ends in a newline, which gRPC metadata refuses.
            token=env.get(TOKEN_ENV, "").strip() or None,
            shm_dir=Path(shm_dir) if shm_dir else None,
            target=env.get(TARGET_ENV, "").strip() or None,
            model=env.get(MODEL_ENV, "").strip() or None,
            ranks=tuple(value for name in RANK_VARIABLES if (value := env.get(name, ""))),
        )

    @property
    def rank_zero(self) -> bool:
        """False when a launcher says this process is a non-zero rank."""
        return all(rank == "0" for rank in self.ranks)
