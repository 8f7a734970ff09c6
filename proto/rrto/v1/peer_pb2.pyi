from rrto.v1 import ops_pb2 as _ops_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PeerHello(_message.Message):
    __slots__ = ("version", "node")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    version: str
    node: str
    def __init__(self, version: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class PeerWelcome(_message.Message):
    __slots__ = ("version", "node", "device", "executors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    version: str
    node: str
    device: str
    executors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., node: _Optional[str] = ..., device: _Optional[str] = ..., executors: _Optional[_Iterable[str]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("sent_ns", "payload")
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    sent_ns: int
    payload: bytes
    def __init__(self, sent_ns: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("sent_ns",)
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    sent_ns: int
    def __init__(self, sent_ns: _Optional[int] = ...) -> None: ...
