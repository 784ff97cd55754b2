from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Member(_message.Message):
    __slots__ = ("role", "name", "epoch", "address", "nixl_metadata", "layout", "region", "http_address", "grant_key")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GRANT_KEY_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    name: str
    epoch: int
    address: str
    nixl_metadata: bytes
    layout: _common_pb2.KvLayout
    region: _common_pb2.KvRegion
    http_address: str
    grant_key: bytes
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., name: _Optional[str] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., region: _Optional[_Union[_common_pb2.KvRegion, _Mapping]] = ..., http_address: _Optional[str] = ..., grant_key: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: Member
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("epoch", "lease_ms")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_ms: int
    def __init__(self, epoch: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: _common_pb2.PeerRef
    def __init__(self, member: _Optional[_Union[_common_pb2.PeerRef, _Mapping]] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("member",)
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    member: _common_pb2.PeerRef
    def __init__(self, member: _Optional[_Union[_common_pb2.PeerRef, _Mapping]] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("kind", "members", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[MembershipEvent.Kind]
        SNAPSHOT: _ClassVar[MembershipEvent.Kind]
        JOINED: _ClassVar[MembershipEvent.Kind]
        LEFT: _ClassVar[MembershipEvent.Kind]
    KIND_UNSPECIFIED: MembershipEvent.Kind
    SNAPSHOT: MembershipEvent.Kind
    JOINED: MembershipEvent.Kind
    LEFT: MembershipEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: MembershipEvent.Kind
    members: _containers.RepeatedCompositeFieldContainer[Member]
    reason: str
    def __init__(self, kind: _Optional[_Union[MembershipEvent.Kind, str]] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersReply(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...
