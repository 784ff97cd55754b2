"""Conversions between protobuf messages and the engine's and kvpoll's own types."""

from __future__ import annotations

import grpc

from libs.engine.logprobs import TokenLogprob
from libs.engine.sampling import SamplingParams
from libs.kvpoll import ROOM_ID_BYTES, RoomKey
from libs.member.bounds import MAX_TOP_LOGPROBS
from libs.rpc.handlers import RpcError, invalid
from pdmesh.v1 import common_pb2 as cpb


def key_from_proto(key: cpb.RoomKey) -> RoomKey:
    if len(key.room) != ROOM_ID_BYTES:
        raise invalid(f"room id must be {ROOM_ID_BYTES} bytes, got {len(key.room)}")
    return RoomKey(key.room, key.generation)


def key_to_proto(key: RoomKey) -> cpb.RoomKey:
    return cpb.RoomKey(room=key.room, generation=key.generation)


def sampling_from_proto(params: cpb.SamplingParams) -> SamplingParams:
    if not 0.0 <= params.temperature <= 2.0:
        raise invalid("sampling.temperature must be in [0, 2]")
    if not 0.0 < params.top_p <= 1.0:
        raise invalid("sampling.top_p must be in (0, 1]")
    if params.max_tokens < 1:
        raise invalid("sampling.max_tokens must be >= 1")
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid(f"sampling.top_logprobs must be at most {MAX_TOP_LOGPROBS}")
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        start_step=params.start_step,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        prompt_logprobs=params.prompt_logprobs,
    )


def logprob_to_proto(logprob: TokenLogprob) -> cpb.TokenLogprob:
    return cpb.TokenLogprob(
        token_id=logprob.token,
        logprob=logprob.logprob,
        top_ids=[token for token, _ in logprob.top],
        top_logprobs=[value for _, value in logprob.top],
    )


def check_tokens(tokens, vocab_size: int, max_len: int) -> list[int]:
    ids = list(tokens)
    if not ids:
        raise invalid("prompt_tokens must not be empty")
    if len(ids) > max_len:
        raise RpcError(
            grpc.StatusCode.OUT_OF_RANGE, f"prompt of {len(ids)} tokens exceeds {max_len}"
        )
    if max(ids) >= vocab_size:
        raise invalid(f"token id {max(ids)} outside the vocabulary of {vocab_size}")
    return ids


def check_abort_ends(named_me: cpb.PeerRef, me: cpb.PeerRef,
                     named_peer: cpb.PeerRef, room_peer: cpb.PeerRef | None) -> None:
    """Refuse an Abort meant for another life of this member, or for another pair's room.

    Empty refs are not checked: the room id alone (128 random bits) names the room.
    """
    if named_me.name and named_me != me:
        raise RpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"stale Abort: it names {named_me.name} epoch {named_me.epoch}, "
            f"this is {me.name} epoch {me.epoch}",
        )
    if named_peer.name and room_peer is not None and named_peer != room_peer:
        raise RpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"Abort names peer {named_peer.name} epoch {named_peer.epoch}, but this room's "
            f"peer is {room_peer.name} epoch {room_peer.epoch}",
        )
