from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_BF16: DType
DTYPE_FP16: DType
DTYPE_FP32: DType

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("version", "weights_hash", "trace_context", "metrics", "canary", "signature", "part_index", "part_count", "part_tensors", "part_hash", "part_encoded", "part_base_version", "part_chunk_bytes")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    PART_COUNT_FIELD_NUMBER: _ClassVar[int]
    PART_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PART_HASH_FIELD_NUMBER: _ClassVar[int]
    PART_ENCODED_FIELD_NUMBER: _ClassVar[int]
    PART_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PART_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_hash: str
    trace_context: _containers.ScalarMap[str, str]
    metrics: _containers.ScalarMap[str, float]
    canary: Canary
    signature: VersionSignature
    part_index: int
    part_count: int
    part_tensors: _containers.RepeatedScalarFieldContainer[str]
    part_hash: str
    part_encoded: bool
    part_base_version: int
    part_chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., weights_hash: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., canary: _Optional[_Union[Canary, _Mapping]] = ..., signature: _Optional[_Union[VersionSignature, _Mapping]] = ..., part_index: _Optional[int] = ..., part_count: _Optional[int] = ..., part_tensors: _Optional[_Iterable[str]] = ..., part_hash: _Optional[str] = ..., part_encoded: _Optional[bool] = ..., part_base_version: _Optional[int] = ..., part_chunk_bytes: _Optional[int] = ...) -> None: ...

class VersionSignature(_message.Message):
    __slots__ = ("content_sha256", "key_id", "signature")
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    content_sha256: str
    key_id: str
    signature: bytes
    def __init__(self, content_sha256: _Optional[str] = ..., key_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Canary(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[CanarySequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[CanarySequence, _Mapping]]] = ...) -> None: ...

class CanarySequence(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("meta", "offset", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    offset: int
    data: bytes
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PartChunks(_message.Message):
    __slots__ = ("meta", "payloads")
    META_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("header", "piece", "chunks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    piece: TensorPiece
    chunks: PartChunks
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., piece: _Optional[_Union[TensorPiece, _Mapping]] = ..., chunks: _Optional[_Union[PartChunks, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "raw_bytes", "encoded_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    raw_bytes: int
    encoded_bytes: int
    def __init__(self, version: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., encoded_bytes: _Optional[int] = ...) -> None: ...

class ChunkRef(_message.Message):
    __slots__ = ("index", "tensor", "size", "sha256")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensor: str
    size: int
    sha256: str
    def __init__(self, index: _Optional[int] = ..., tensor: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("version", "base_version", "tensors", "chunks", "weights_hash", "codec", "raw_bytes", "encoded_bytes", "trace_context", "canary", "signature")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    weights_hash: str
    codec: str
    raw_bytes: int
    encoded_bytes: int
    trace_context: _containers.ScalarMap[str, str]
    canary: Canary
    signature: VersionSignature
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ..., weights_hash: _Optional[str] = ..., codec: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., encoded_bytes: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., canary: _Optional[_Union[Canary, _Mapping]] = ..., signature: _Optional[_Union[VersionSignature, _Mapping]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_version", "follow", "resume", "resume_version", "resume_base", "resume_chunk")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RESUME_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_BASE_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHUNK_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    follow: bool
    resume: bool
    resume_version: int
    resume_base: int
    resume_chunk: int
    def __init__(self, from_version: _Optional[int] = ..., follow: _Optional[bool] = ..., resume: _Optional[bool] = ..., resume_version: _Optional[int] = ..., resume_base: _Optional[int] = ..., resume_chunk: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("manifest", "chunk", "batch")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    chunk: ChunkData
    batch: ChunkBatch
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., chunk: _Optional[_Union[ChunkData, _Mapping]] = ..., batch: _Optional[_Union[ChunkBatch, _Mapping]] = ...) -> None: ...

class ChunkBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkData]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkData, _Mapping]]] = ...) -> None: ...

class ChunkData(_message.Message):
    __slots__ = ("version", "index", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FetchChunkRequest(_message.Message):
    __slots__ = ("version", "base_version", "index")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    index: int
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class WeightSyncStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightSyncStatus(_message.Message):
    __slots__ = ("latest_version", "versions", "stored_bytes", "role", "chunks_sent", "chunk_bytes_sent", "resumed_streams", "chunk_fetches", "compacted_built", "upstream_versions", "upstream_bytes", "chunk_bytes", "encoded_parts", "encoded_parts_refused")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FETCHES_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_BUILT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_PARTS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_PARTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    stored_bytes: int
    role: str
    chunks_sent: int
    chunk_bytes_sent: int
    resumed_streams: int
    chunk_fetches: int
    compacted_built: int
    upstream_versions: int
    upstream_bytes: int
    chunk_bytes: int
    encoded_parts: int
    encoded_parts_refused: int
    def __init__(self, latest_version: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., stored_bytes: _Optional[int] = ..., role: _Optional[str] = ..., chunks_sent: _Optional[int] = ..., chunk_bytes_sent: _Optional[int] = ..., resumed_streams: _Optional[int] = ..., chunk_fetches: _Optional[int] = ..., compacted_built: _Optional[int] = ..., upstream_versions: _Optional[int] = ..., upstream_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., encoded_parts: _Optional[int] = ..., encoded_parts_refused: _Optional[int] = ...) -> None: ...
