from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("member", "model", "kind", "page_keys", "page_size", "enabled")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KvCacheEvent.Kind]
        SNAPSHOT: _ClassVar[KvCacheEvent.Kind]
        STORED: _ClassVar[KvCacheEvent.Kind]
        REMOVED: _ClassVar[KvCacheEvent.Kind]
    KIND_UNSPECIFIED: KvCacheEvent.Kind
    SNAPSHOT: KvCacheEvent.Kind
    STORED: KvCacheEvent.Kind
    REMOVED: KvCacheEvent.Kind
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    member: _common_pb2.PeerRef
    model: str
    kind: KvCacheEvent.Kind
    page_keys: _containers.RepeatedScalarFieldContainer[bytes]
    page_size: int
    enabled: bool
    def __init__(self, member: _Optional[_Union[_common_pb2.PeerRef, _Mapping]] = ..., model: _Optional[str] = ..., kind: _Optional[_Union[KvCacheEvent.Kind, str]] = ..., page_keys: _Optional[_Iterable[bytes]] = ..., page_size: _Optional[int] = ..., enabled: _Optional[bool] = ...) -> None: ...
