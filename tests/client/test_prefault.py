"""Destinations' host memory faulted in ahead of the load (weightstream.client.prefault), on real memory.

Every load_into / load_targets runs through Prefault, so the bit-exact load tests elsewhere also
check that populating racing with the receive changes no byte. These check the pieces: pages are
resident afterwards (a write takes no page fault), contents are kept, spans are those of the views.
"""

from __future__ import annotations

import mmap
import platform
import resource
import time
import warnings

import pytest
import torch

from weightstream import allocator
from weightstream.client.placement import Destination
from weightstream.client.prefault import Prefault, host_span, populate

PAGES = 1024  # 4 MiB of 4 KiB pages


def _kernel_has_populate() -> bool:
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


pytestmark = pytest.mark.skipif(not _kernel_has_populate(), reason="MADV_POPULATE_WRITE needs Linux 5.14")


def _fresh(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Anonymous memory no page of which has been touched, and a uint8 tensor over it."""
    memory = mmap.mmap(-1, nbytes)
    return memory, torch.frombuffer(memory, dtype=torch.uint8)


def _faults_writing_every_page(tensor: torch.Tensor) -> int:
    """Minor page faults this thread takes writing one byte into every page of tensor (uint8)."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    tensor[:: mmap.PAGESIZE] = 7
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_populated_pages_take_no_fault_and_keep_their_bytes() -> None:
    _memory, control = _fresh(PAGES * mmap.PAGESIZE)
    assert _faults_writing_every_page(control) >= PAGES // 2  # the measure sees first-touch faults

    _memory2, tensor = _fresh(PAGES * mmap.PAGESIZE)
    half = PAGES // 2 * mmap.PAGESIZE
    tensor[:half] = torch.arange(half, dtype=torch.int64).remainder(251).to(torch.uint8)
    expected = tensor[:half].clone()
    # An unaligned span: the pages at both ends are widened to whole pages.
    assert populate(int(tensor.data_ptr()) + 100, tensor.numel() - 200)
    assert torch.equal(tensor[:half], expected)
    assert int(tensor[half:].count_nonzero()) == 0
    assert _faults_writing_every_page(tensor) <= 2


def test_prefault_populates_a_plain_and_a_staged_destination_and_skips_a_complete_one() -> None:
    _m1, plain_bytes = _fresh(PAGES * mmap.PAGESIZE)
    plain = Destination("plain", plain_bytes.view(torch.float32))
    _m2, wide = _fresh(PAGES * mmap.PAGESIZE)
    # bfloat16 bytes received into staging, converted into a float32 view: both are populated.
    staged = Destination("staged", wide.view(torch.float32), dtype=torch.bfloat16)
    assert staged.staged and not plain.staged
    _m3, done_bytes = _fresh(PAGES * mmap.PAGESIZE)
    done = Destination("done", done_bytes.view(torch.float32))
    done.landed.add(0, done.nbytes)

    work = Prefault([done, plain, staged])
    expected = plain.nbytes + staged.nbytes + wide.numel()
    deadline = time.monotonic() + 30
    while work.populated_bytes < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    work.close()
    assert work.populated_bytes == expected
    assert _faults_writing_every_page(plain_bytes) <= 2
    assert _faults_writing_every_page(wide) <= 2
    assert _faults_writing_every_page(done_bytes) >= PAGES // 2  # complete: never touched


def test_host_span_covers_a_strided_view_from_its_first_to_its_last_element() -> None:
    matrix = torch.zeros(8, 16, dtype=torch.float32)
    columns = matrix[:, 4:6]  # two columns of every row
    address, length = host_span(columns) or (0, 0)
    assert address == matrix.data_ptr() + 4 * 4
    assert length == (7 * 16 + 1 + 1) * 4  # last element: row 7, column 5
    assert host_span(torch.empty(0)) is None
    assert host_span(torch.empty(4, device="meta")) is None


def test_memory_that_refuses_population_is_left_to_the_receive() -> None:
    memory = mmap.mmap(-1, PAGES * mmap.PAGESIZE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable, which is the point
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(memory, dtype=torch.uint8)  # read-only: a write fault is refused
    assert not populate(int(tensor.data_ptr()), tensor.numel())
    assert allocator.populate_supported()  # one refusal does not turn it off for every later load


def test_closing_stops_it_between_steps_without_populating_the_rest() -> None:
    """A load that ends early (an error, a cancel) must not keep a thread faulting in a whole model."""
    nbytes = 1024 * 1024 * 1024
    _memory, tensor = _fresh(nbytes)  # virtual only until populated
    work = Prefault([Destination("big", tensor)])
    started = time.monotonic()
    work.close()
    assert time.monotonic() - started < 5
    assert work.populated_bytes < nbytes
    populated = work.populated_bytes
    time.sleep(0.2)
    assert work.populated_bytes == populated  # the thread is gone
