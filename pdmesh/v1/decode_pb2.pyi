from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("key", "prompt_tokens", "sampling", "prefill", "prompt_token_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.RoomKey
    prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    prefill: _common_pb2.PeerRef
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill: _Optional[_Union[_common_pb2.PeerRef, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("finish_reason", "completion_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    completion_tokens: int
    def __init__(self, finish_reason: _Optional[str] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Preempted(_message.Message):
    __slots__ = ("completion_tokens",)
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    completion_tokens: int
    def __init__(self, completion_tokens: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("transfer", "tokens", "finish", "kv_arrived", "preempted")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    KV_ARRIVED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    transfer: _common_pb2.TransferInfo
    tokens: TokenChunk
    finish: Finish
    kv_arrived: KvArrived
    preempted: Preempted
    def __init__(self, transfer: _Optional[_Union[_common_pb2.TransferInfo, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., kv_arrived: _Optional[_Union[KvArrived, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ...) -> None: ...

class KvArrived(_message.Message):
    __slots__ = ("prompt_tokens",)
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ...) -> None: ...
