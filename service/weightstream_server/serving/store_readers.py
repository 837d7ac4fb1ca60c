"""Reader processes: reads of the kinds of object store that this process's Run:ai streamer cannot make.

The streamer's object-storage backend is chosen once per process, not per streamer: the first
object store the process reads (S3, GCS or Azure) loads that store's plugin, and from then on every
object read of every streamer in the process goes to it. A gs:// URL handed to the S3 plugin fails
"File access error"; a streamer that read one kind and is handed another refuses with "Streamer is
locked to a single object-storage backend". So the server reads the first kind it reads in its own
process (reader.StreamerPool), and each other kind in a reader process of that kind's own
(StoreReader, one per kind, started at the first read of the kind and again if it died): a server
then serves s3://, gs:// and az:// models at once.

The reader process is `python -m weightstream_server.serving.store_readers`, with this process's
environment (the streamer's and the stores' variables, set at start-up) and a StreamerPool of
--max-streams streamers. It listens on a Unix socket in a folder of mode 0700, so that only this
user (who could read the server's memory anyway) may connect; it exits when its stdin closes, that
is when the server's process ends. Every wait on it is bounded: its listen backlog holds more
connections than streams may be open, so connecting never blocks, and each reply is awaited for
the storage timeout (which it enforces on its reads itself) plus REPLY_MARGIN_S.

Each stream is one connection: the parent sends (model, files, plan, read-ahead), the reader
process reads the plan with reader.read_object_units (windows, the storage timeout, stuck
streamers and every length and count check, as in the server's own process) and sends each read
unit as it arrives, then "end" or the error.

Copies: one more than in the server's process: the reader process's ring -> the socket -> the
parent's receive buffer. Memory: each stream's receive buffer is as large as its largest read unit,
besides the reader process's rings (bounded by --read-ahead-bytes per stream, as here).

Concurrency: a StoreReader is shared by the streams of its kind, each on a connection of its own.
The reader process serves each connection on a thread of its own; its streamers are checked out of
its pool as here, one stream at a time each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING

import torch
from runai_model_streamer.s3_utils.s3_utils import S3Credentials

from weightstream_server import errors
from weightstream_server.errors import ServerError, StorageUnavailable

if TYPE_CHECKING:
    from weightstream_server.storage.reads import ReadPlan
    from weightstream_server.storage.sources import SourceFile

logger = logging.getLogger(__name__)

# Seconds a reader process may take to start (it imports torch and the streamer) and listen.
START_TIMEOUT_S = 60.0
# Seconds a stream waits for its reader process beyond the storage timeout, which the reader
# process enforces itself: past both, the reader process is taken to be stuck.
REPLY_MARGIN_S = 30.0
STOP_TIMEOUT_S = 5.0
_POLL_S = 0.05
# What the reader process runs (named, not imported: it imports the reader, which imports this).
_PROCESS_MODULE = "weightstream_server.serving.store_reader_process"


class StoreReader:
    """The reader process of one kind of object store (scheme: "s3://", "gs://" or "az://"), started when first used.

    size, storage_timeout, s3_credentials: those of the reader process's StreamerPool (see
    reader.StreamerPool). reply_margin: how much longer than storage_timeout a reply is awaited.
    Thread-safe: read_units may run on many threads at once.
    """

    def __init__(
        self,
        scheme: str,
        size: int,
        storage_timeout: float,
        s3_credentials: S3Credentials | None = None,
        reply_margin: float = REPLY_MARGIN_S,
    ) -> None:
        self.scheme = scheme
        # The S3 settings travel as "-" (none) or the endpoint and region, "" where unset.
        s3 = (
            ["-", "", ""]
            if s3_credentials is None
            else ["+", s3_credentials.endpoint or "", s3_credentials.region_name or ""]
        )
        self._args = [scheme, str(size), repr(storage_timeout), *s3]
        self._reply_wait = storage_timeout + reply_margin
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._folder: str | None = None
        self._address = ""
        self._closed = False

    def read_units(
        self, model: str, files: Sequence[SourceFile], plan: ReadPlan, read_ahead_bytes: int
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """As reader.read_units: (index in plan.files, index of the unit, its bytes as flat uint8) per read
        unit, each a view of this stream's receive buffer valid until the next item is taken.

        A reader process that is found gone before its first answer (killed, crashed) is started
        again and asked once more; one that fails after that fails the stream."""
        for attempt in (1, 2):
            conn = self._connect(model)
            try:
                conn.send((model, tuple(files), plan, read_ahead_bytes))
                first = self._receive(conn, model)
                break
            except (OSError, StorageUnavailable) as exc:
                conn.close()
                gone = exc if isinstance(exc, StorageUnavailable) else self._gone(model, exc)
                if attempt == 2 or "sent nothing" in str(gone):
                    raise gone from exc
                with self._lock:
                    self._stop()  # whatever is left of it: the next connect starts another
        with conn:
            buffer = torch.empty(0, dtype=torch.uint8)
            while True:
                message, first = first or self._receive(conn, model), ()
                if message[0] == "end":
                    return
                if message[0] == "error":
                    raise _error(message[1], message[2])
                file_id, index, length = _unit(message)
                if buffer.numel() < length:
                    buffer = torch.empty(length, dtype=torch.uint8)
                try:
                    received = conn.recv_bytes_into(buffer.numpy().data)
                except (OSError, EOFError) as exc:
                    raise self._gone(model, exc) from exc
                if received != length:
                    raise StorageUnavailable(
                        f"model {model!r}: the {self.scheme} reader process sent {received} bytes, announced {length}"
                    )
                yield file_id, index, buffer[:length]

    @property
    def pid(self) -> int | None:
        """The reader process's id while one was started (it may have exited since)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def close(self) -> None:
        """Stop the reader process (it ends its streams in flight) and remove its socket's folder."""
        with self._lock:
            self._closed = True
            self._stop()

    def _receive(self, conn: Connection, model: str) -> tuple[object, ...]:
        wait = self._reply_wait
        try:
            if not conn.poll(wait):
                raise StorageUnavailable(
                    f"model {model!r}: the {self.scheme} reader process sent nothing for {wait:g} s; try again"
                )
            message = conn.recv()
        except (OSError, EOFError) as exc:
            raise self._gone(model, exc) from exc
        if not isinstance(message, tuple) or not message:
            raise StorageUnavailable(f"model {model!r}: the {self.scheme} reader process sent {type(message).__name__}")
        return message

    def _gone(self, model: str, exc: BaseException) -> StorageUnavailable:
        code = self._proc.poll() if self._proc is not None else None
        how = f"exited with {code}" if code is not None else f"closed the connection ({type(exc).__name__})"
        return StorageUnavailable(f"model {model!r}: the {self.scheme} reader process {how}; try again")

    def _connect(self, model: str) -> Connection:
        """A connection to the reader process, started first if it is not running."""
        with self._lock:
            if self._closed:
                raise StorageUnavailable(f"model {model!r}: the server is stopping")
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    logger.warning(
                        "the %s reader process exited with %s; starting another", self.scheme, self._proc.returncode
                    )
                self._stop()
                self._start()
            address, proc = self._address, self._proc
        assert proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return Client(address, family="AF_UNIX")
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                # Still starting: it listens once it has imported the streamer.
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise self._gone(model, exc) from exc
                time.sleep(_POLL_S)
            except (OSError, EOFError) as exc:
                raise self._gone(model, exc) from exc

    def _start(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="weightstream-reader-")  # mode 0700
        self._address = os.path.join(self._folder, "socket")
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        command = [sys.executable, "-m", _PROCESS_MODULE, *self._args, self._address, str(level)]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        logger.info("started the %s reader process (pid %d)", self.scheme, self._proc.pid)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # it exits when its stdin closes
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def _unit(message: tuple[object, ...]) -> tuple[int, int, int]:
    """(index in plan.files, index of the unit, its length) of a reader process's ("unit", ...) message."""
    if len(message) != 4 or message[0] != "unit" or not all(isinstance(v, int) for v in message[1:]):
        raise StorageUnavailable(f"a reader process sent an unknown message {str(message)[:200]}")
    return message[1], message[2], message[3]  # type: ignore[return-value]


def _error(name: object, text: object) -> ServerError:
    """The server's exception named name (from a reader process), StorageUnavailable for any other name."""
    kind = getattr(errors, str(name), None)
    if isinstance(kind, type) and issubclass(kind, ServerError):
        return kind(str(text))
    return StorageUnavailable(str(text))
