"""A store's reader process (serving/store_readers.py): started again after it died, and given up on in
bounded time when it stops answering.

Real reader processes (`python -m weightstream_server.serving.store_readers`) reading a real GCS
emulator on 127.0.0.1; a reader process is killed or stopped with signals to its own process id.
tests/server/test_mixed_object_stores.py serves all three kinds of store from one server.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.object_stores import Emulator, gcs_client, gcs_emulator
from weightstream_server.errors import StorageUnavailable
from weightstream_server.serving.store_readers import StoreReader
from weightstream_server.storage.reads import ChunkPlace, FilePlan, ReadPlan, UnitPlace
from weightstream_server.storage.sources import SourceFile

# Reader processes import torch and the streamer as they start (seconds each).
pytestmark = pytest.mark.slow

BUCKET = "ws-readers"
DATA = bytes(range(256)) * 4096 + b"tail"
NO_READS = ReadPlan(files=(), total_bytes=0, num_reads=0, chunk_bytes=1 << 20)
WAIT_S = 10.0


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The GCS emulator holding DATA as gs://BUCKET/m/blob, with the streamer's GCS backend pointed at it."""
    with gcs_emulator(tmp_path_factory.mktemp("readers")) as emulator:
        client = gcs_client(emulator)
        client.create_bucket(BUCKET)
        client.bucket(BUCKET).blob("m/blob").upload_from_string(DATA)
        with pytest.MonkeyPatch.context() as env:
            # What weightstream_server.storage.gcs.configure_gcs sets at a server's start; reader processes inherit it.
            env.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", emulator.endpoint)
            yield emulator


def _read_blob(reader: StoreReader) -> bytes:
    """DATA read through reader, in two units."""
    half = len(DATA) // 2
    sizes = [half, len(DATA) - half]
    places = [UnitPlace(ChunkPlace("blob", 0, half)), UnitPlace(ChunkPlace("blob", half, sizes[1]))]
    plan = ReadPlan((FilePlan(0, [0, half], sizes, places),), len(DATA), 2, 1 << 20)
    blob = SourceFile("blob", f"gs://{BUCKET}/m/blob", len(DATA), "1")
    pieces = {
        index: bytes(data.numpy()) for _, index, data in reader.read_units(f"gs://{BUCKET}/m", [blob], plan, 1 << 20)
    }
    return pieces[0] + pieces[1]


def _wait_state(pid: int, states: str) -> None:
    """Wait until process pid is in one of states (/proc's letters: Z zombie, T stopped)."""
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in states:
        assert time.monotonic() < deadline, f"process {pid} not in state {states} after {WAIT_S} s"
        time.sleep(0.01)


def test_a_reader_process_that_died_is_started_again(emulator: Emulator) -> None:
    reader = StoreReader("gs://", 2, storage_timeout=30.0)
    try:
        assert _read_blob(reader) == DATA
        first = reader.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _wait_state(first, "Z")  # dead; reaped by the reader when it looks
        assert _read_blob(reader) == DATA
        assert reader.pid not in (None, first)
    finally:
        reader.close()


def test_a_reader_process_that_stops_answering_is_unavailable_within_its_bound(emulator: Emulator) -> None:
    reader = StoreReader("gs://", 1, storage_timeout=0.2, reply_margin=0.3)
    streams = ThreadPoolExecutor(1)
    pid = None
    try:
        assert list(reader.read_units(f"gs://{BUCKET}/m", [], NO_READS, 1 << 20)) == []
        pid = reader.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        _wait_state(pid, "T")
        started = time.monotonic()
        stream = streams.submit(lambda: list(reader.read_units(f"gs://{BUCKET}/m", [], NO_READS, 1 << 20)))
        with pytest.raises(StorageUnavailable, match=rf"gs://{BUCKET}/m.*reader process sent nothing for 0.5 s"):
            stream.result(timeout=WAIT_S)
        assert time.monotonic() - started < 5
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        reader.close()  # a stream still waiting (were there no bound) sees the reader process end
        streams.shutdown()
