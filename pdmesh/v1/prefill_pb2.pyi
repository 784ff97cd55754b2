from pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("key", "prompt_tokens", "sampling", "transfer")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.RoomKey
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    transfer: _common_pb2.TransferInfo
    def __init__(self, key: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., transfer: _Optional[_Union[_common_pb2.TransferInfo, _Mapping]] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("tokens_done", "pages_sent")
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    tokens_done: int
    pages_sent: int
    def __init__(self, tokens_done: _Optional[int] = ..., pages_sent: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: PrefillProgress
    result: _common_pb2.TransferResult
    def __init__(self, progress: _Optional[_Union[PrefillProgress, _Mapping]] = ..., result: _Optional[_Union[_common_pb2.TransferResult, _Mapping]] = ...) -> None: ...
