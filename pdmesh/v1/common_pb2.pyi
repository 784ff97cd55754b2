from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoomState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_STATE_UNSPECIFIED: _ClassVar[RoomState]
    BOOTSTRAPPING: _ClassVar[RoomState]
    WAITING_FOR_INPUT: _ClassVar[RoomState]
    TRANSFERRING: _ClassVar[RoomState]
    SUCCESS: _ClassVar[RoomState]
    FAILED: _ClassVar[RoomState]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    BOOTSTRAP: _ClassVar[Role]
    PREFILL: _ClassVar[Role]
    DECODE: _ClassVar[Role]
    ROUTER: _ClassVar[Role]

class TransferStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATUS_UNSPECIFIED: _ClassVar[TransferStatus]
    TRANSFER_OK: _ClassVar[TransferStatus]
    TRANSFER_FAILED: _ClassVar[TransferStatus]
ROOM_STATE_UNSPECIFIED: RoomState
BOOTSTRAPPING: RoomState
WAITING_FOR_INPUT: RoomState
TRANSFERRING: RoomState
SUCCESS: RoomState
FAILED: RoomState
ROLE_UNSPECIFIED: Role
BOOTSTRAP: Role
PREFILL: Role
DECODE: Role
ROUTER: Role
TRANSFER_STATUS_UNSPECIFIED: TransferStatus
TRANSFER_OK: TransferStatus
TRANSFER_FAILED: TransferStatus

class RoomKey(_message.Message):
    __slots__ = ("room", "generation")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    room: bytes
    generation: int
    def __init__(self, room: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class PeerRef(_message.Message):
    __slots__ = ("name", "epoch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "top_k", "start_step", "logprobs", "top_logprobs", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    top_k: int
    start_step: int
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., top_k: _Optional[int] = ..., start_step: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "page_bytes", "transfer_format", "wire_page_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WIRE_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_bytes: int
    transfer_format: str
    wire_page_bytes: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_bytes: _Optional[int] = ..., transfer_format: _Optional[str] = ..., wire_page_bytes: _Optional[int] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("base_addr", "num_pages", "mem_type", "device_id")
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    base_addr: int
    num_pages: int
    mem_type: str
    device_id: int
    def __init__(self, base_addr: _Optional[int] = ..., num_pages: _Optional[int] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("key", "decode", "dst_pages", "grant", "grant_expires_unix_ms", "held_pages")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    GRANT_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    key: RoomKey
    decode: PeerRef
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    grant: bytes
    grant_expires_unix_ms: int
    held_pages: int
    def __init__(self, key: _Optional[_Union[RoomKey, _Mapping]] = ..., decode: _Optional[_Union[PeerRef, _Mapping]] = ..., dst_pages: _Optional[_Iterable[int]] = ..., grant: _Optional[bytes] = ..., grant_expires_unix_ms: _Optional[int] = ..., held_pages: _Optional[int] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("key", "status", "error", "first_token", "pages_written", "bytes_written", "transfer_seconds", "prefill", "decode", "first_logprob", "prompt_logprobs", "cached_tokens", "computed_tokens", "bytes_skipped")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    key: RoomKey
    status: TransferStatus
    error: str
    first_token: int
    pages_written: int
    bytes_written: int
    transfer_seconds: float
    prefill: PeerRef
    decode: PeerRef
    first_logprob: TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cached_tokens: int
    computed_tokens: int
    bytes_skipped: int
    def __init__(self, key: _Optional[_Union[RoomKey, _Mapping]] = ..., status: _Optional[_Union[TransferStatus, str]] = ..., error: _Optional[str] = ..., first_token: _Optional[int] = ..., pages_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., prefill: _Optional[_Union[PeerRef, _Mapping]] = ..., decode: _Optional[_Union[PeerRef, _Mapping]] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., bytes_skipped: _Optional[int] = ...) -> None: ...

class KvReady(_message.Message):
    __slots__ = ("key", "prefill", "num_pages", "prompt_tokens", "first_token")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    key: RoomKey
    prefill: PeerRef
    num_pages: int
    prompt_tokens: int
    first_token: int
    def __init__(self, key: _Optional[_Union[RoomKey, _Mapping]] = ..., prefill: _Optional[_Union[PeerRef, _Mapping]] = ..., num_pages: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("key", "reason", "writer_fenced", "prefill", "decode", "stage")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WRITER_FENCED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    key: RoomKey
    reason: str
    writer_fenced: bool
    prefill: PeerRef
    decode: PeerRef
    stage: str
    def __init__(self, key: _Optional[_Union[RoomKey, _Mapping]] = ..., reason: _Optional[str] = ..., writer_fenced: _Optional[bool] = ..., prefill: _Optional[_Union[PeerRef, _Mapping]] = ..., decode: _Optional[_Union[PeerRef, _Mapping]] = ..., stage: _Optional[str] = ...) -> None: ...

class AbortAck(_message.Message):
    __slots__ = ("key", "known", "state", "released")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    key: RoomKey
    known: bool
    state: RoomState
    released: bool
    def __init__(self, key: _Optional[_Union[RoomKey, _Mapping]] = ..., known: _Optional[bool] = ..., state: _Optional[_Union[RoomState, str]] = ..., released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberStats(_message.Message):
    __slots__ = ("role", "name", "epoch", "healthy", "inflight", "kv_pages_used", "kv_pages_total", "rooms", "transfer_failed_total", "aborts_total", "requests_total", "pinned", "pid", "deadline_expired_total", "aborts_by_reason", "prompt_tokens_computed_total", "metrics_address", "queue_depth", "preemptions_total", "kv_pages_cached", "prefix_cache_queries_total", "prefix_cache_query_tokens_total", "prefix_cache_hits_total", "kv_transfer_bytes_moved_total", "kv_transfer_bytes_skipped_total")
    class RoomsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AbortsByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ABORTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ABORTS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_MOVED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_SKIPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    role: Role
    name: str
    epoch: int
    healthy: bool
    inflight: int
    kv_pages_used: int
    kv_pages_total: int
    rooms: _containers.ScalarMap[str, int]
    transfer_failed_total: int
    aborts_total: int
    requests_total: int
    pinned: _containers.RepeatedCompositeFieldContainer[PinnedRoom]
    pid: int
    deadline_expired_total: int
    aborts_by_reason: _containers.ScalarMap[str, int]
    prompt_tokens_computed_total: int
    metrics_address: str
    queue_depth: int
    preemptions_total: int
    kv_pages_cached: int
    prefix_cache_queries_total: int
    prefix_cache_query_tokens_total: int
    prefix_cache_hits_total: int
    kv_transfer_bytes_moved_total: int
    kv_transfer_bytes_skipped_total: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., name: _Optional[str] = ..., epoch: _Optional[int] = ..., healthy: _Optional[bool] = ..., inflight: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., rooms: _Optional[_Mapping[str, int]] = ..., transfer_failed_total: _Optional[int] = ..., aborts_total: _Optional[int] = ..., requests_total: _Optional[int] = ..., pinned: _Optional[_Iterable[_Union[PinnedRoom, _Mapping]]] = ..., pid: _Optional[int] = ..., deadline_expired_total: _Optional[int] = ..., aborts_by_reason: _Optional[_Mapping[str, int]] = ..., prompt_tokens_computed_total: _Optional[int] = ..., metrics_address: _Optional[str] = ..., queue_depth: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., prefix_cache_queries_total: _Optional[int] = ..., prefix_cache_query_tokens_total: _Optional[int] = ..., prefix_cache_hits_total: _Optional[int] = ..., kv_transfer_bytes_moved_total: _Optional[int] = ..., kv_transfer_bytes_skipped_total: _Optional[int] = ...) -> None: ...

class PinnedRoom(_message.Message):
    __slots__ = ("room", "generation", "state", "age_seconds", "idle_seconds", "peer")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    room: str
    generation: int
    state: RoomState
    age_seconds: float
    idle_seconds: float
    peer: str
    def __init__(self, room: _Optional[str] = ..., generation: _Optional[int] = ..., state: _Optional[_Union[RoomState, str]] = ..., age_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., peer: _Optional[str] = ...) -> None: ...

class DumpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DumpReply(_message.Message):
    __slots__ = ("name", "pid", "threads", "tasks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    pid: int
    threads: _containers.RepeatedCompositeFieldContainer[StackDump]
    tasks: _containers.RepeatedCompositeFieldContainer[StackDump]
    def __init__(self, name: _Optional[str] = ..., pid: _Optional[int] = ..., threads: _Optional[_Iterable[_Union[StackDump, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[StackDump, _Mapping]]] = ...) -> None: ...

class StackDump(_message.Message):
    __slots__ = ("name", "stack")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    stack: str
    def __init__(self, name: _Optional[str] = ..., stack: _Optional[str] = ...) -> None: ...
