from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_BOOL: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]
    DATA_TYPE_INT16: _ClassVar[DataType]
    DATA_TYPE_UINT16: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_UINT32: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]
    DATA_TYPE_UINT64: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_BFLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_FLOAT64: _ClassVar[DataType]
    DATA_TYPE_FLOAT8_E4M3FN: _ClassVar[DataType]
    DATA_TYPE_FLOAT8_E5M2: _ClassVar[DataType]

class ChunkEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNK_ENCODING_UNSPECIFIED: _ClassVar[ChunkEncoding]
    CHUNK_ENCODING_XOR_ZSTD: _ClassVar[ChunkEncoding]
    CHUNK_ENCODING_SPARSE_XOR_ZSTD: _ClassVar[ChunkEncoding]

class ModelFileKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_FILE_KIND_UNSPECIFIED: _ClassVar[ModelFileKind]
    MODEL_FILE_KIND_WEIGHTS: _ClassVar[ModelFileKind]
    MODEL_FILE_KIND_COMPANION: _ClassVar[ModelFileKind]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_BOOL: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_INT8: DataType
DATA_TYPE_INT16: DataType
DATA_TYPE_UINT16: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_UINT32: DataType
DATA_TYPE_INT64: DataType
DATA_TYPE_UINT64: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_BFLOAT16: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_FLOAT64: DataType
DATA_TYPE_FLOAT8_E4M3FN: DataType
DATA_TYPE_FLOAT8_E5M2: DataType
CHUNK_ENCODING_UNSPECIFIED: ChunkEncoding
CHUNK_ENCODING_XOR_ZSTD: ChunkEncoding
CHUNK_ENCODING_SPARSE_XOR_ZSTD: ChunkEncoding
MODEL_FILE_KIND_UNSPECIFIED: ModelFileKind
MODEL_FILE_KIND_WEIGHTS: ModelFileKind
MODEL_FILE_KIND_COMPANION: ModelFileKind

class GetManifestRequest(_message.Message):
    __slots__ = ("model", "revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("model", "revision", "total_bytes", "files", "tensors", "digest")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    total_bytes: int
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    digest: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., total_bytes: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., digest: _Optional[str] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "file_index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    file_index: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., file_index: _Optional[int] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class TensorRequest(_message.Message):
    __slots__ = ("name", "ranges", "slice", "delta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    name: str
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    slice: TensorSlice
    delta: bool
    def __init__(self, name: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., slice: _Optional[_Union[TensorSlice, _Mapping]] = ..., delta: _Optional[bool] = ...) -> None: ...

class TensorSlice(_message.Message):
    __slots__ = ("dim", "start", "stop")
    DIM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    dim: int
    start: int
    stop: int
    def __init__(self, dim: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class StreamTensorsRequest(_message.Message):
    __slots__ = ("model", "tensors", "max_chunk_bytes", "revision", "delta_base")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    model: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRequest]
    max_chunk_bytes: int
    revision: str
    delta_base: str
    def __init__(self, model: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorRequest, _Mapping]]] = ..., max_chunk_bytes: _Optional[int] = ..., revision: _Optional[str] = ..., delta_base: _Optional[str] = ...) -> None: ...

class StreamTensorsResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor", "offset", "crc32c", "length", "slot", "slot_offset", "encoding", "encoded_length", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ENCODED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: int
    crc32c: int
    length: int
    slot: int
    slot_offset: int
    encoding: ChunkEncoding
    encoded_length: int
    data: bytes
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., crc32c: _Optional[int] = ..., length: _Optional[int] = ..., slot: _Optional[int] = ..., slot_offset: _Optional[int] = ..., encoding: _Optional[_Union[ChunkEncoding, str]] = ..., encoded_length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListModelFilesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListModelFilesResponse(_message.Message):
    __slots__ = ("model", "revision", "files")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ...) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("name", "size_bytes", "kind", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    kind: ModelFileKind
    version: str
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., kind: _Optional[_Union[ModelFileKind, str]] = ..., version: _Optional[str] = ...) -> None: ...

class ReadModelFileRequest(_message.Message):
    __slots__ = ("model", "file", "offset", "revision", "max_chunk_bytes", "length", "data_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    file: str
    offset: int
    revision: str
    max_chunk_bytes: int
    length: int
    data_port: bool
    def __init__(self, model: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., revision: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., length: _Optional[int] = ..., data_port: _Optional[bool] = ...) -> None: ...

class ReadModelFileResponse(_message.Message):
    __slots__ = ("offset", "crc32c", "file_crc32c", "data_host", "data_port", "ticket", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    FILE_CRC32C_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    crc32c: int
    file_crc32c: int
    data_host: str
    data_port: int
    ticket: bytes
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., crc32c: _Optional[int] = ..., file_crc32c: _Optional[int] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class OpenSharedMemoryRequest(_message.Message):
    __slots__ = ("nonce_file", "nonce")
    NONCE_FILE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce_file: str
    nonce: bytes
    def __init__(self, nonce_file: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class OpenSharedMemoryResponse(_message.Message):
    __slots__ = ("max_ring_bytes",)
    MAX_RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_ring_bytes: int
    def __init__(self, max_ring_bytes: _Optional[int] = ...) -> None: ...

class StreamTensorsSharedRequest(_message.Message):
    __slots__ = ("request", "slots", "slot_bytes", "released_slots")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    request: StreamTensorsRequest
    slots: int
    slot_bytes: int
    released_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request: _Optional[_Union[StreamTensorsRequest, _Mapping]] = ..., slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., released_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamTensorsSharedResponse(_message.Message):
    __slots__ = ("segment_socket", "ticket", "slots", "slot_bytes", "chunks")
    SEGMENT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    segment_socket: str
    ticket: bytes
    slots: int
    slot_bytes: int
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, segment_socket: _Optional[str] = ..., ticket: _Optional[bytes] = ..., slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class StreamTensorsBulkRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: StreamTensorsRequest
    def __init__(self, request: _Optional[_Union[StreamTensorsRequest, _Mapping]] = ...) -> None: ...

class StreamTensorsBulkResponse(_message.Message):
    __slots__ = ("data_host", "data_port", "ticket")
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    data_host: str
    data_port: int
    ticket: bytes
    def __init__(self, data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class PublishStart(_message.Message):
    __slots__ = ("model", "revision", "tensors", "part", "parts", "new_layout", "data_port", "delta_base")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NEW_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    tensors: _containers.RepeatedCompositeFieldContainer[PublishedTensor]
    part: int
    parts: int
    new_layout: bool
    data_port: bool
    delta_base: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[PublishedTensor, _Mapping]]] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., new_layout: _Optional[bool] = ..., data_port: _Optional[bool] = ..., delta_base: _Optional[str] = ...) -> None: ...

class PublishedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("start", "chunks", "commit")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    start: PublishStart
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    commit: bool
    def __init__(self, start: _Optional[_Union[PublishStart, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., commit: _Optional[bool] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("model", "revision", "complete", "bytes", "data_host", "data_port", "ticket")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    complete: bool
    bytes: int
    data_host: str
    data_port: int
    ticket: bytes
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., complete: _Optional[bool] = ..., bytes: _Optional[int] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class GetChangesRequest(_message.Message):
    __slots__ = ("model", "since", "revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    since: str
    revision: str
    def __init__(self, model: _Optional[str] = ..., since: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class TensorChanges(_message.Message):
    __slots__ = ("name", "ranges", "whole")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    whole: bool
    def __init__(self, name: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., whole: _Optional[bool] = ...) -> None: ...

class GetChangesResponse(_message.Message):
    __slots__ = ("model", "since", "revision", "tensors", "changed_bytes", "block_bytes", "removed", "blocks")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    since: str
    revision: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorChanges]
    changed_bytes: int
    block_bytes: int
    removed: _containers.RepeatedScalarFieldContainer[str]
    blocks: _containers.RepeatedCompositeFieldContainer[TensorBlocks]
    def __init__(self, model: _Optional[str] = ..., since: _Optional[str] = ..., revision: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorChanges, _Mapping]]] = ..., changed_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., removed: _Optional[_Iterable[str]] = ..., blocks: _Optional[_Iterable[_Union[TensorBlocks, _Mapping]]] = ...) -> None: ...

class TensorBlocks(_message.Message):
    __slots__ = ("name", "crc32c")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    name: str
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchModelRequest(_message.Message):
    __slots__ = ("model", "after", "peer_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    PEER_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    after: str
    peer_port: int
    def __init__(self, model: _Optional[str] = ..., after: _Optional[str] = ..., peer_port: _Optional[int] = ...) -> None: ...

class WatchModelResponse(_message.Message):
    __slots__ = ("model", "revision", "origin", "total_bytes", "kept", "peer")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    origin: str
    total_bytes: int
    kept: _containers.RepeatedScalarFieldContainer[str]
    peer: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., origin: _Optional[str] = ..., total_bytes: _Optional[int] = ..., kept: _Optional[_Iterable[str]] = ..., peer: _Optional[str] = ...) -> None: ...

class GetBlockHashesRequest(_message.Message):
    __slots__ = ("model", "revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class GetBlockHashesResponse(_message.Message):
    __slots__ = ("tensor", "hashes")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tensor: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StreamRevisionBlocksRequest(_message.Message):
    __slots__ = ("model", "revision", "tensors", "first_block", "refused_peer", "keepalive_ms", "since", "wanted")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PEER_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_MS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    WANTED_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    first_block: int
    refused_peer: str
    keepalive_ms: int
    since: str
    wanted: bytes
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ..., first_block: _Optional[int] = ..., refused_peer: _Optional[str] = ..., keepalive_ms: _Optional[int] = ..., since: _Optional[str] = ..., wanted: _Optional[bytes] = ...) -> None: ...

class StreamRevisionBlocksResponse(_message.Message):
    __slots__ = ("index", "waiting", "encoding", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    waiting: bool
    encoding: ChunkEncoding
    data: bytes
    def __init__(self, index: _Optional[int] = ..., waiting: _Optional[bool] = ..., encoding: _Optional[_Union[ChunkEncoding, str]] = ..., data: _Optional[bytes] = ...) -> None: ...
