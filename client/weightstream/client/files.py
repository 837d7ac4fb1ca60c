"""Reading a model's whole files from the server: ListModelFiles and ReadModelFile, each piece checked."""

from __future__ import annotations

from collections.abc import Iterator

from weightstream.client.channels import Channels
from weightstream.client.errors import IntegrityError, translated
from weightstream.client.manifest import ModelFileList, files_from_proto
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb


class RemoteFiles:
    """The files of the server's models, read over the main channel of channels (target names it in errors).

    Thread-safe as the channels are: each read runs its own call.
    """

    def __init__(self, channels: Channels, target: str, *, chunk_bytes: int, timeout: float | None) -> None:
        self._channels = channels
        self._target = target
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout

    def list_files(self, model: str) -> ModelFileList:
        """The files of model the server lets a client read whole: weight files and companion files."""
        with translated(self._target):
            response = self._channels.stub.ListModelFiles(
                pb.ListModelFilesRequest(model=model), timeout=self._timeout, metadata=self._channels.metadata
            )
        return files_from_proto(response)

    def read_file(
        self, model: str, name: str, *, offset: int = 0, revision: str = "", length: int = 0
    ) -> Iterator[tuple[bytes, int | None]]:
        """Yield (data, file_crc32c) pieces of model's file name from offset, in order, each CRC32C-checked.

        file_crc32c is None except on the last piece, where it is the server's CRC32C of the whole
        file from byte 0; a stream that ends without it raises IntegrityError. With length (not 0),
        only that many bytes are read and no piece carries file_crc32c; fewer raise IntegrityError.
        With revision, the server refuses (FailedPreconditionError) if the model's files changed
        since that listing.
        """
        request = pb.ReadModelFileRequest(
            model=model,
            file=name,
            offset=offset,
            revision=revision,
            max_chunk_bytes=self._chunk_bytes,
            length=length,
        )
        where = f"model {model!r}, file {name!r}"
        expected = offset
        finished = False
        call = self._channels.stub.ReadModelFile(request, metadata=self._channels.metadata)
        try:
            with translated(self._target):
                for message in call:
                    if finished or message.offset != expected:
                        raise IntegrityError(f"{where}: received bytes at offset {message.offset}, expected {expected}")
                    data = message.data  # each access of a protobuf bytes field makes a new copy
                    if wire.crc32c(data) != message.crc32c:
                        raise IntegrityError(
                            f"{where}: CRC32C mismatch in the chunk at offset {message.offset} "
                            f"({len(data)} bytes); the data was corrupted in transit"
                        )
                    expected += len(data)
                    if length:
                        if expected > offset + length:
                            raise IntegrityError(f"{where}: received bytes past offset {offset + length}")
                        finished = expected == offset + length
                        yield data, None
                        continue
                    finished = message.HasField("file_crc32c")
                    yield data, message.file_crc32c if finished else None
        finally:
            call.cancel()
        if not finished:
            end = f"offset {offset + length}" if length else "the end of the file"
            raise IntegrityError(f"{where}: the stream ended at offset {expected}, before {end}")
