from rrto.v1 import ops_pb2 as _ops_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CtlRequest(_message.Message):
    __slots__ = ("command", "args")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    command: str
    args: _containers.ScalarMap[str, str]
    def __init__(self, command: _Optional[str] = ..., args: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CtlReply(_message.Message):
    __slots__ = ("ok", "json", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    json: str
    error: str
    def __init__(self, ok: _Optional[bool] = ..., json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class AppHello(_message.Message):
    __slots__ = ("app", "pid", "argv", "executor", "versions", "shared_uploads")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    APP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    app: str
    pid: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    executor: str
    versions: _containers.ScalarMap[str, str]
    shared_uploads: bool
    def __init__(self, app: _Optional[str] = ..., pid: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., executor: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ..., shared_uploads: _Optional[bool] = ...) -> None: ...

class AppWelcome(_message.Message):
    __slots__ = ("session", "host", "device", "shared_bytes")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: str
    host: str
    device: str
    shared_bytes: int
    def __init__(self, session: _Optional[str] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., shared_bytes: _Optional[int] = ...) -> None: ...

class SharedUpload(_message.Message):
    __slots__ = ("seq", "slot", "meta", "offset", "length", "palette", "palette_block")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PALETTE_FIELD_NUMBER: _ClassVar[int]
    PALETTE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    seq: int
    slot: int
    meta: bytes
    offset: int
    length: int
    palette: bytes
    palette_block: int
    def __init__(self, seq: _Optional[int] = ..., slot: _Optional[int] = ..., meta: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., palette: _Optional[bytes] = ..., palette_block: _Optional[int] = ...) -> None: ...

class InferenceMark(_message.Message):
    __slots__ = ("index", "start_ns", "end_ns", "thread", "search_wait_us", "left_replay")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    SEARCH_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    LEFT_REPLAY_FIELD_NUMBER: _ClassVar[int]
    index: int
    start_ns: int
    end_ns: int
    thread: int
    search_wait_us: int
    left_replay: bool
    def __init__(self, index: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., thread: _Optional[int] = ..., search_wait_us: _Optional[int] = ..., left_replay: _Optional[bool] = ...) -> None: ...

class LocalRequest(_message.Message):
    __slots__ = ("app_hello", "session", "ctl", "mark", "shared_upload")
    APP_HELLO_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CTL_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    SHARED_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    app_hello: AppHello
    session: _ops_pb2.SessionUp
    ctl: CtlRequest
    mark: InferenceMark
    shared_upload: SharedUpload
    def __init__(self, app_hello: _Optional[_Union[AppHello, _Mapping]] = ..., session: _Optional[_Union[_ops_pb2.SessionUp, _Mapping]] = ..., ctl: _Optional[_Union[CtlRequest, _Mapping]] = ..., mark: _Optional[_Union[InferenceMark, _Mapping]] = ..., shared_upload: _Optional[_Union[SharedUpload, _Mapping]] = ...) -> None: ...

class LocalReply(_message.Message):
    __slots__ = ("welcome", "session", "ctl", "error", "shared_done")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CTL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SHARED_DONE_FIELD_NUMBER: _ClassVar[int]
    welcome: AppWelcome
    session: _ops_pb2.SessionDown
    ctl: CtlReply
    error: _ops_pb2.Error
    shared_done: int
    def __init__(self, welcome: _Optional[_Union[AppWelcome, _Mapping]] = ..., session: _Optional[_Union[_ops_pb2.SessionDown, _Mapping]] = ..., ctl: _Optional[_Union[CtlReply, _Mapping]] = ..., error: _Optional[_Union[_ops_pb2.Error, _Mapping]] = ..., shared_done: _Optional[int] = ...) -> None: ...
