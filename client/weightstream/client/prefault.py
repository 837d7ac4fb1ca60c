"""Host memory of a load's destinations faulted in on a helper thread, ahead of the bytes landing there.

A parameter that an engine has just allocated (torch.empty) has no pages yet: the first write to
each 4 KiB page traps into the kernel, which finds and zeroes a page. On a loaded machine or in a
virtual machine that can be a large part of a load (docs/how-to/vllm.md measures it).
Faulting the pages in with madvise(MADV_POPULATE_WRITE) (Linux 5.14) costs the kernel the same
zeroing without a trap per page, and on this thread it overlaps with the network: by the time a
chunk arrives its pages are usually there. Contents are never changed (the call faults pages in
as a write would, without writing), so racing with the receive is harmless: a page the receive
reaches first is faulted by it, and populating it again is a page-table walk. Memory that is
already resident costs little more than that walk. Where the kernel lacks the call (or the
memory refuses it), nothing happens and the receive faults the pages as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import torch

from weightstream.allocator import populate, populate_supported
from weightstream.client.placement import Destination

logger = logging.getLogger(__name__)

# One madvise call's span: small enough that closing the prefault (a load's end or error) waits
# for little, large enough that the calls cost nothing beside the faults they spare.
STEP_BYTES = 32 * 1024 * 1024


def host_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, length) of the host memory a CPU tensor's elements lie in; None for other devices or no elements."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or any(stride < 0 for stride in tensor.stride()):
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return int(tensor.data_ptr()), (last + 1) * tensor.element_size()


class Prefault:
    """Populates the host memory of dests (each one's buffer, then the views a staged one is copied into) in order.

    Started at once on a daemon thread; close() stops it between two steps and waits for it. A
    destination complete by the time its turn comes is skipped.
    """

    def __init__(self, dests: Iterable[Destination]) -> None:
        self._dests = list(dests)
        self._stop = threading.Event()
        self.populated_bytes = 0
        self._thread: threading.Thread | None = None
        if populate_supported() and any(host_span(d.buffer) for d in self._dests):
            self._thread = threading.Thread(target=self._run, name="weightstream-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for dest in self._dests:
            if dest.complete:
                continue
            views = (dest.buffer, dest.target, *dest.also) if dest.staged else (dest.buffer,)
            for view in views:
                span = host_span(view)
                if span is None:
                    continue
                address, length = span
                for offset in range(0, length, STEP_BYTES):
                    if self._stop.is_set():
                        return
                    step = min(STEP_BYTES, length - offset)
                    if not populate(address + offset, step):
                        break  # this memory refuses it (read-only, say); the next view may not
                    self.populated_bytes += step

    def close(self) -> None:
        """Stop populating and wait for the call in progress (at most one step)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Prefault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
