from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GradMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAD_MODE_UNSPECIFIED: _ClassVar[GradMode]
    GRAD_ENABLED: _ClassVar[GradMode]
    NO_GRAD: _ClassVar[GradMode]
    INFERENCE_MODE: _ClassVar[GradMode]
GRAD_MODE_UNSPECIFIED: GradMode
GRAD_ENABLED: GradMode
NO_GRAD: GradMode
INFERENCE_MODE: GradMode

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "stride", "storage_offset", "device", "requires_grad")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    device: str
    requires_grad: bool
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., device: _Optional[str] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("meta", "data", "palette", "palette_block")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PALETTE_FIELD_NUMBER: _ClassVar[int]
    PALETTE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    data: bytes
    palette: bytes
    palette_block: int
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., palette: _Optional[bytes] = ..., palette_block: _Optional[int] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("id", "upload", "persistent", "bind_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    BIND_ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    upload: TensorData
    persistent: bytes
    bind_id: int
    def __init__(self, id: _Optional[int] = ..., upload: _Optional[_Union[TensorData, _Mapping]] = ..., persistent: _Optional[bytes] = ..., bind_id: _Optional[int] = ...) -> None: ...

class ValueList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Complex(_message.Message):
    __slots__ = ("real", "imag")
    REAL_FIELD_NUMBER: _ClassVar[int]
    IMAG_FIELD_NUMBER: _ClassVar[int]
    real: float
    imag: float
    def __init__(self, real: _Optional[float] = ..., imag: _Optional[float] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("none", "b", "i", "f", "s", "tensor", "list", "dtype", "device", "layout", "memory_format", "c", "tuple")
    NONE_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    F_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    C_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    none: bool
    b: bool
    i: int
    f: float
    s: str
    tensor: TensorRef
    list: ValueList
    dtype: str
    device: str
    layout: str
    memory_format: str
    c: Complex
    tuple: ValueList
    def __init__(self, none: _Optional[bool] = ..., b: _Optional[bool] = ..., i: _Optional[int] = ..., f: _Optional[float] = ..., s: _Optional[str] = ..., tensor: _Optional[_Union[TensorRef, _Mapping]] = ..., list: _Optional[_Union[ValueList, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., layout: _Optional[str] = ..., memory_format: _Optional[str] = ..., c: _Optional[_Union[Complex, _Mapping]] = ..., tuple: _Optional[_Union[ValueList, _Mapping]] = ...) -> None: ...

class OpCall(_message.Message):
    __slots__ = ("seq", "op", "args", "kwargs", "out_ids", "sync", "want_meta", "grad_mode", "thread", "out_meta", "schema")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    OUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    WANT_META_FIELD_NUMBER: _ClassVar[int]
    GRAD_MODE_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    OUT_META_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    seq: int
    op: str
    args: _containers.RepeatedCompositeFieldContainer[Value]
    kwargs: _containers.MessageMap[str, Value]
    out_ids: _containers.RepeatedScalarFieldContainer[int]
    sync: bool
    want_meta: bool
    grad_mode: GradMode
    thread: int
    out_meta: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    schema: bytes
    def __init__(self, seq: _Optional[int] = ..., op: _Optional[str] = ..., args: _Optional[_Iterable[_Union[Value, _Mapping]]] = ..., kwargs: _Optional[_Mapping[str, Value]] = ..., out_ids: _Optional[_Iterable[int]] = ..., sync: _Optional[bool] = ..., want_meta: _Optional[bool] = ..., grad_mode: _Optional[_Union[GradMode, str]] = ..., thread: _Optional[int] = ..., out_meta: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., schema: _Optional[bytes] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("seq", "outs", "value")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OUTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    outs: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    value: Value
    def __init__(self, seq: _Optional[int] = ..., outs: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class Fetch(_message.Message):
    __slots__ = ("seq", "id", "in_forward")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    IN_FORWARD_FIELD_NUMBER: _ClassVar[int]
    seq: int
    id: int
    in_forward: bool
    def __init__(self, seq: _Optional[int] = ..., id: _Optional[int] = ..., in_forward: _Optional[bool] = ...) -> None: ...

class Fetched(_message.Message):
    __slots__ = ("seq", "tensor", "id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tensor: TensorData
    id: int
    def __init__(self, seq: _Optional[int] = ..., tensor: _Optional[_Union[TensorData, _Mapping]] = ..., id: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("ids", "gaps", "progress")
    IDS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    gaps: _containers.RepeatedScalarFieldContainer[int]
    progress: ReplayProgress
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., gaps: _Optional[_Iterable[int]] = ..., progress: _Optional[_Union[ReplayProgress, _Mapping]] = ...) -> None: ...

class ReplayProgress(_message.Message):
    __slots__ = ("base_id", "position")
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    base_id: int
    position: int
    def __init__(self, base_id: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class BlobPut(_message.Message):
    __slots__ = ("hash", "tensor")
    HASH_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    tensor: TensorData
    def __init__(self, hash: _Optional[bytes] = ..., tensor: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class BlobQuery(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlobQueryReply(_message.Message):
    __slots__ = ("missing",)
    MISSING_FIELD_NUMBER: _ClassVar[int]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "seq", "sequence", "base_id", "position", "in_replay")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    IN_REPLAY_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    seq: int
    sequence: int
    base_id: int
    position: int
    in_replay: bool
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., seq: _Optional[int] = ..., sequence: _Optional[int] = ..., base_id: _Optional[int] = ..., position: _Optional[int] = ..., in_replay: _Optional[bool] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("app", "pid", "uid", "robot", "executor", "memory_quota", "versions", "part_bytes")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    APP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    ROBOT_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_QUOTA_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    app: str
    pid: int
    uid: int
    robot: str
    executor: str
    memory_quota: int
    versions: _containers.ScalarMap[str, str]
    part_bytes: int
    def __init__(self, app: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., robot: _Optional[str] = ..., executor: _Optional[str] = ..., memory_quota: _Optional[int] = ..., versions: _Optional[_Mapping[str, str]] = ..., part_bytes: _Optional[int] = ...) -> None: ...

class SessionReady(_message.Message):
    __slots__ = ("session", "device", "versions")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    session: str
    device: str
    versions: _containers.ScalarMap[str, str]
    def __init__(self, session: _Optional[str] = ..., device: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionUp(_message.Message):
    __slots__ = ("open", "call", "fetch", "release", "blob", "query", "close", "define", "start", "arg", "abort", "batch", "profile", "part", "part_bytes")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    DEFINE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    call: OpCall
    fetch: Fetch
    release: Release
    blob: BlobPut
    query: BlobQuery
    close: Close
    define: SequenceDef
    start: ReplayStart
    arg: ReplayArg
    abort: ReplayAbort
    batch: SessionUpBatch
    profile: SequenceProfile
    part: MessagePart
    part_bytes: int
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., call: _Optional[_Union[OpCall, _Mapping]] = ..., fetch: _Optional[_Union[Fetch, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., blob: _Optional[_Union[BlobPut, _Mapping]] = ..., query: _Optional[_Union[BlobQuery, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., define: _Optional[_Union[SequenceDef, _Mapping]] = ..., start: _Optional[_Union[ReplayStart, _Mapping]] = ..., arg: _Optional[_Union[ReplayArg, _Mapping]] = ..., abort: _Optional[_Union[ReplayAbort, _Mapping]] = ..., batch: _Optional[_Union[SessionUpBatch, _Mapping]] = ..., profile: _Optional[_Union[SequenceProfile, _Mapping]] = ..., part: _Optional[_Union[MessagePart, _Mapping]] = ..., part_bytes: _Optional[int] = ...) -> None: ...

class MessagePart(_message.Message):
    __slots__ = ("data", "last")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    last: bool
    def __init__(self, data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class SessionUpBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[SessionUp]
    def __init__(self, frames: _Optional[_Iterable[_Union[SessionUp, _Mapping]]] = ...) -> None: ...

class SessionDown(_message.Message):
    __slots__ = ("ready", "result", "fetched", "query", "error", "sequence", "defined", "batch", "answer", "replayed", "search", "profile", "timing", "sizes", "parts", "part")
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DEFINED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    SEARCH_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    ready: SessionReady
    result: OpResult
    fetched: Fetched
    query: BlobQueryReply
    error: Error
    sequence: SequenceDef
    defined: SequenceAck
    batch: SessionDownBatch
    answer: ReplayAnswer
    replayed: ReplayedPrefix
    search: SearchHint
    profile: SequenceProfile
    timing: ReplayTiming
    sizes: ReplaySizes
    parts: PartsReceived
    part: MessagePart
    def __init__(self, ready: _Optional[_Union[SessionReady, _Mapping]] = ..., result: _Optional[_Union[OpResult, _Mapping]] = ..., fetched: _Optional[_Union[Fetched, _Mapping]] = ..., query: _Optional[_Union[BlobQueryReply, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., sequence: _Optional[_Union[SequenceDef, _Mapping]] = ..., defined: _Optional[_Union[SequenceAck, _Mapping]] = ..., batch: _Optional[_Union[SessionDownBatch, _Mapping]] = ..., answer: _Optional[_Union[ReplayAnswer, _Mapping]] = ..., replayed: _Optional[_Union[ReplayedPrefix, _Mapping]] = ..., search: _Optional[_Union[SearchHint, _Mapping]] = ..., profile: _Optional[_Union[SequenceProfile, _Mapping]] = ..., timing: _Optional[_Union[ReplayTiming, _Mapping]] = ..., sizes: _Optional[_Union[ReplaySizes, _Mapping]] = ..., parts: _Optional[_Union[PartsReceived, _Mapping]] = ..., part: _Optional[_Union[MessagePart, _Mapping]] = ...) -> None: ...

class PartsReceived(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class ReplaySizes(_message.Message):
    __slots__ = ("base_id", "positions", "ranks", "dims")
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    base_id: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, base_id: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[int]] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplayTiming(_message.Message):
    __slots__ = ("sequence", "plan", "upload_bytes", "upload_ns")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_NS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    plan: int
    upload_bytes: int
    upload_ns: int
    def __init__(self, sequence: _Optional[int] = ..., plan: _Optional[int] = ..., upload_bytes: _Optional[int] = ..., upload_ns: _Optional[int] = ...) -> None: ...

class SequenceProfile(_message.Message):
    __slots__ = ("sequence", "plan", "call_ns", "replays")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CALL_NS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    plan: int
    call_ns: _containers.RepeatedScalarFieldContainer[int]
    replays: int
    def __init__(self, sequence: _Optional[int] = ..., plan: _Optional[int] = ..., call_ns: _Optional[_Iterable[int]] = ..., replays: _Optional[int] = ...) -> None: ...

class SearchHint(_message.Message):
    __slots__ = ("running", "wait_us")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAIT_US_FIELD_NUMBER: _ClassVar[int]
    running: bool
    wait_us: int
    def __init__(self, running: _Optional[bool] = ..., wait_us: _Optional[int] = ...) -> None: ...

class SessionDownBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[SessionDown]
    def __init__(self, frames: _Optional[_Iterable[_Union[SessionDown, _Mapping]]] = ...) -> None: ...

class SequenceAck(_message.Message):
    __slots__ = ("id", "accepted", "reason", "pinned")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    id: int
    accepted: bool
    reason: str
    pinned: str
    def __init__(self, id: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., pinned: _Optional[str] = ...) -> None: ...

class SeqSource(_message.Message):
    __slots__ = ("kind", "id", "hash", "meta", "any_shape", "fixed")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SeqSource.Kind]
        INPUT: _ClassVar[SeqSource.Kind]
        PRODUCED: _ClassVar[SeqSource.Kind]
        CONSTANT: _ClassVar[SeqSource.Kind]
        PERSISTENT: _ClassVar[SeqSource.Kind]
    KIND_UNSPECIFIED: SeqSource.Kind
    INPUT: SeqSource.Kind
    PRODUCED: SeqSource.Kind
    CONSTANT: SeqSource.Kind
    PERSISTENT: SeqSource.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    ANY_SHAPE_FIELD_NUMBER: _ClassVar[int]
    FIXED_FIELD_NUMBER: _ClassVar[int]
    kind: SeqSource.Kind
    id: int
    hash: bytes
    meta: TensorMeta
    any_shape: bool
    fixed: bool
    def __init__(self, kind: _Optional[_Union[SeqSource.Kind, str]] = ..., id: _Optional[int] = ..., hash: _Optional[bytes] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., any_shape: _Optional[bool] = ..., fixed: _Optional[bool] = ...) -> None: ...

class SequenceDef(_message.Message):
    __slots__ = ("id", "calls", "local_ids", "sources", "outputs", "thread", "symbols", "varies_from", "loops", "plans", "plan", "profile")
    ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    SYMBOLS_FIELD_NUMBER: _ClassVar[int]
    VARIES_FROM_FIELD_NUMBER: _ClassVar[int]
    LOOPS_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    id: int
    calls: _containers.RepeatedCompositeFieldContainer[OpCall]
    local_ids: _containers.RepeatedScalarFieldContainer[int]
    sources: _containers.RepeatedCompositeFieldContainer[SeqSource]
    outputs: _containers.RepeatedScalarFieldContainer[int]
    thread: int
    symbols: _containers.RepeatedCompositeFieldContainer[SymbolicInt]
    varies_from: int
    loops: _containers.RepeatedCompositeFieldContainer[SeqLoop]
    plans: _containers.RepeatedCompositeFieldContainer[Plan]
    plan: int
    profile: bool
    def __init__(self, id: _Optional[int] = ..., calls: _Optional[_Iterable[_Union[OpCall, _Mapping]]] = ..., local_ids: _Optional[_Iterable[int]] = ..., sources: _Optional[_Iterable[_Union[SeqSource, _Mapping]]] = ..., outputs: _Optional[_Iterable[int]] = ..., thread: _Optional[int] = ..., symbols: _Optional[_Iterable[_Union[SymbolicInt, _Mapping]]] = ..., varies_from: _Optional[int] = ..., loops: _Optional[_Iterable[_Union[SeqLoop, _Mapping]]] = ..., plans: _Optional[_Iterable[_Union[Plan, _Mapping]]] = ..., plan: _Optional[int] = ..., profile: _Optional[bool] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("robot_calls", "split_calls", "split_at")
    ROBOT_CALLS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_CALLS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_AT_FIELD_NUMBER: _ClassVar[int]
    robot_calls: _containers.RepeatedScalarFieldContainer[int]
    split_calls: _containers.RepeatedScalarFieldContainer[int]
    split_at: float
    def __init__(self, robot_calls: _Optional[_Iterable[int]] = ..., split_calls: _Optional[_Iterable[int]] = ..., split_at: _Optional[float] = ...) -> None: ...

class SeqLoop(_message.Message):
    __slots__ = ("start", "body", "tensor", "dim", "gathers", "scatters", "guards", "variants")
    START_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    GATHERS_FIELD_NUMBER: _ClassVar[int]
    SCATTERS_FIELD_NUMBER: _ClassVar[int]
    GUARDS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    start: int
    body: int
    tensor: int
    dim: int
    gathers: _containers.RepeatedCompositeFieldContainer[Gather]
    scatters: _containers.RepeatedScalarFieldContainer[int]
    guards: _containers.RepeatedScalarFieldContainer[int]
    variants: _containers.RepeatedCompositeFieldContainer[LoopVariant]
    def __init__(self, start: _Optional[int] = ..., body: _Optional[int] = ..., tensor: _Optional[int] = ..., dim: _Optional[int] = ..., gathers: _Optional[_Iterable[_Union[Gather, _Mapping]]] = ..., scatters: _Optional[_Iterable[int]] = ..., guards: _Optional[_Iterable[int]] = ..., variants: _Optional[_Iterable[_Union[LoopVariant, _Mapping]]] = ...) -> None: ...

class LoopVariant(_message.Message):
    __slots__ = ("when", "calls", "sources", "symbols", "local_ids", "outputs")
    WHEN_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SYMBOLS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    when: _containers.RepeatedScalarFieldContainer[float]
    calls: _containers.RepeatedCompositeFieldContainer[OpCall]
    sources: _containers.RepeatedCompositeFieldContainer[SeqSource]
    symbols: _containers.RepeatedCompositeFieldContainer[SymbolicInt]
    local_ids: _containers.RepeatedScalarFieldContainer[int]
    outputs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, when: _Optional[_Iterable[float]] = ..., calls: _Optional[_Iterable[_Union[OpCall, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[SeqSource, _Mapping]]] = ..., symbols: _Optional[_Iterable[_Union[SymbolicInt, _Mapping]]] = ..., local_ids: _Optional[_Iterable[int]] = ..., outputs: _Optional[_Iterable[int]] = ...) -> None: ...

class Gather(_message.Message):
    __slots__ = ("call", "arg", "kwarg", "items")
    CALL_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    KWARG_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    call: int
    arg: int
    kwarg: str
    items: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, call: _Optional[int] = ..., arg: _Optional[int] = ..., kwarg: _Optional[str] = ..., items: _Optional[_Iterable[int]] = ...) -> None: ...

class SymbolicInt(_message.Message):
    __slots__ = ("call", "arg", "kwarg", "items", "tensor", "dim", "span", "value", "index")
    CALL_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    KWARG_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    call: int
    arg: int
    kwarg: str
    items: _containers.RepeatedScalarFieldContainer[int]
    tensor: int
    dim: int
    span: int
    value: bool
    index: bool
    def __init__(self, call: _Optional[int] = ..., arg: _Optional[int] = ..., kwarg: _Optional[str] = ..., items: _Optional[_Iterable[int]] = ..., tensor: _Optional[int] = ..., dim: _Optional[int] = ..., span: _Optional[int] = ..., value: _Optional[bool] = ..., index: _Optional[bool] = ...) -> None: ...

class ReplayAnswer(_message.Message):
    __slots__ = ("base_id", "position", "result")
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    base_id: int
    position: int
    result: OpResult
    def __init__(self, base_id: _Optional[int] = ..., position: _Optional[int] = ..., result: _Optional[_Union[OpResult, _Mapping]] = ...) -> None: ...

class ReplayedPrefix(_message.Message):
    __slots__ = ("base_id", "start", "calls")
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    base_id: int
    start: int
    calls: _containers.RepeatedCompositeFieldContainer[OutSizes]
    def __init__(self, base_id: _Optional[int] = ..., start: _Optional[int] = ..., calls: _Optional[_Iterable[_Union[OutSizes, _Mapping]]] = ...) -> None: ...

class OutSizes(_message.Message):
    __slots__ = ("outs",)
    OUTS_FIELD_NUMBER: _ClassVar[int]
    outs: _containers.RepeatedCompositeFieldContainer[Sizes]
    def __init__(self, outs: _Optional[_Iterable[_Union[Sizes, _Mapping]]] = ...) -> None: ...

class Sizes(_message.Message):
    __slots__ = ("dims", "known")
    DIMS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    known: bool
    def __init__(self, dims: _Optional[_Iterable[int]] = ..., known: _Optional[bool] = ...) -> None: ...

class ReplayStart(_message.Message):
    __slots__ = ("sequence", "base_id", "inference", "position", "joined", "plan", "loop_count", "loop_choices", "here")
    class JoinedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    LOOP_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOOP_CHOICES_FIELD_NUMBER: _ClassVar[int]
    HERE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    base_id: int
    inference: int
    position: int
    joined: _containers.ScalarMap[int, int]
    plan: int
    loop_count: int
    loop_choices: _containers.RepeatedScalarFieldContainer[int]
    here: bool
    def __init__(self, sequence: _Optional[int] = ..., base_id: _Optional[int] = ..., inference: _Optional[int] = ..., position: _Optional[int] = ..., joined: _Optional[_Mapping[int, int]] = ..., plan: _Optional[int] = ..., loop_count: _Optional[int] = ..., loop_choices: _Optional[_Iterable[int]] = ..., here: _Optional[bool] = ...) -> None: ...

class ReplayArg(_message.Message):
    __slots__ = ("slot", "tensor", "same_as")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SAME_AS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    tensor: TensorRef
    same_as: int
    def __init__(self, slot: _Optional[int] = ..., tensor: _Optional[_Union[TensorRef, _Mapping]] = ..., same_as: _Optional[int] = ...) -> None: ...

class ReplayAbort(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...
