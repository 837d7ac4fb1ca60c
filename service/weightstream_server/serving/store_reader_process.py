"""The reader process of one kind of object store: `python -m weightstream_server.serving.store_reader_process`.

Started by serving.store_readers.StoreReader (which says what travels between the two): it claims
its kind of store for the Run:ai streamer of this process, keeps a StreamerPool, and serves each
stream's read plan on a connection of its own, until the server closes its stdin.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener

from runai_model_streamer.s3_utils.s3_utils import S3Credentials

from weightstream_server.errors import ServerError
from weightstream_server.serving.reader import StreamerPool, claim_backend, read_object_units

logger = logging.getLogger(__name__)

# Connections queued beyond those of --max-streams streams.
_SPARE_BACKLOG = 16
_POLL_S = 0.05


def _serve_stream(pool: StreamerPool, conn: Connection) -> None:
    """Read the plan of one stream (one connection) and send its units, then "end" or the error."""
    model = "?"
    with conn:
        try:
            model, files, plan, read_ahead_bytes = conn.recv()
            with pool.checkout() as streamer:
                units = read_object_units(streamer, model, files, plan, read_ahead_bytes)
                # Closed before the streamer goes back to the pool: its reads are drained by then.
                with contextlib.closing(units):
                    for file_id, index, data in units:
                        conn.send(("unit", file_id, index, data.numel()))
                        conn.send_bytes(data.numpy().data)
            conn.send(("end",))
        except (OSError, EOFError):
            return  # the stream ended on the server's side (a client that cancelled, say)
        except ServerError as exc:
            with contextlib.suppress(OSError):
                conn.send(("error", type(exc).__name__, str(exc)))
        except Exception as exc:
            logger.exception("model %r: the read failed", model)
            with contextlib.suppress(OSError):
                conn.send(("error", "StorageUnavailable", f"model {model!r}: the read failed: {exc}"))


def _exit_with_parent() -> None:
    """Wait until stdin closes (the server stopped this process, or ended), then exit at once."""
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    os._exit(0)


def main(argv: Sequence[str]) -> None:
    scheme, size, storage_timeout, has_s3, endpoint, region, address, level = argv
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s %(name)s [{scheme} reader]: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: this process ends with the server's (stdin).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    claim_backend(scheme)
    credentials = S3Credentials(endpoint=endpoint or None, region_name=region or None) if has_s3 == "+" else None
    pool = StreamerPool(int(size), credentials, float(storage_timeout))
    threading.Thread(target=_exit_with_parent, name="weightstream-reader-parent", daemon=True).start()
    with Listener(address, family="AF_UNIX", backlog=int(size) + _SPARE_BACKLOG) as listener:
        while True:
            try:
                conn = listener.accept()
            except OSError as exc:  # out of descriptors, say: the streams in flight go on
                logger.warning("cannot accept a stream: %s", exc)
                time.sleep(_POLL_S)
                continue
            threading.Thread(target=_serve_stream, args=(pool, conn), name="weightstream-reader", daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
