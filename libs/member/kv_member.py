"""What a prefill and a decode process share: model, KV pool, NIXL agent, peers.

A KvMember owns the model and the KV pool (allocated and registered with NIXL
once), builds its registration for the bootstrap, and keeps the NIXL agents of
the opposite role in step with membership: a peer that joins is added only if
its KV layout matches ours, transfer format included (a mismatch is refused at
registration, never found as a hang, and remembered so a request naming that
peer is refused with the reason); a peer that leaves, or re-registers under a
new epoch, has its old agent dropped at once and its rooms failed by the
listeners.

What NIXL registers depends on the KV transfer format (libs/transfer/staging.py):
the pool itself for native, a staging region of one NVFP4 slot per KV page for
nvfp4.

Without ``--kv-pages`` the pool is sized to the device (libs/member/sizing.py), after
the weights are loaded; a start that runs out of CUDA memory raises DoesNotFit, whose
message names the stage and the flag to change.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from libs.engine.engine import Engine
from libs.engine.kvpool import KvPool
from libs.engine.loader import LoadedModel, load_model
from libs.faults import Faults
from libs.member import sizing
from libs.member.pairable import layout_mismatch
from libs.member.timeouts import TIMEOUTS
from libs.transfer.agent import KvAgent
from libs.transfer.kvwire import Nvfp4PageFormat
from libs.transfer.layout import PoolLayout
from libs.transfer.staging import KvWire
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb

log = logging.getLogger(__name__)

PeerListener = Callable[[bpb.Member, str], None]


@dataclass
class Peer:
    """A live member of the opposite role whose NIXL agent we hold."""

    member: bpb.Member
    agent_name: str
    layout: PoolLayout

    @property
    def ref(self) -> cpb.PeerRef:
        return cpb.PeerRef(name=self.member.name, epoch=self.member.epoch)


def model_fingerprint(loaded: LoadedModel) -> str:
    """Name plus a hash of a slice of the weights: same name, other weights is a mismatch.
    NVFP4 linears are other weights too (the embedding is not quantized, so say it)."""
    sample = loaded.weights.embed.flatten()[:65536].float().cpu().numpy().tobytes()
    fmt = "" if loaded.weights_format == "native" else f"+{loaded.weights_format}"
    return f"{loaded.name}{fmt}@{hashlib.sha256(sample).hexdigest()[:12]}"


_ROLE_NAMES = {cpb.PREFILL: "prefill", cpb.DECODE: "decode"}


class DoesNotFit(RuntimeError):
    """The member cannot start in the device memory it has; the message says what to change."""


def bytes_per_page(loaded: LoadedModel, page_size: int, kv_transfer: str) -> int:
    """Device bytes one KV page costs: the page, plus its NVFP4 staging slot if any."""
    c = loaded.config
    page = c.n_layers * 2 * c.n_kv_heads * page_size * c.head_dim
    page *= loaded.weights.embed.element_size()
    if kv_transfer == "native":
        return page
    return page + Nvfp4PageFormat(c.n_layers, c.n_kv_heads, page_size, c.head_dim).slot_bytes


def pool_pages(
    role_name: str, loaded: LoadedModel, device: str, page_size: int, kv_transfer: str,
    memory_fraction: float | None, max_rooms: int,
) -> int:
    """The pool's size when no --kv-pages says: fixed on the CPU, what this member's share
    of the GPU holds on CUDA (libs/member/sizing.py). Logs the choice."""
    if not sizing.is_cuda(device):
        return sizing.CPU_KV_PAGES[role_name]
    fraction = sizing.DEFAULT_GPU_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    per_page = bytes_per_page(loaded, page_size, kv_transfer)
    # No room holds more than a full context, and there are at most max_rooms of them.
    max_pages = max_rooms * -(-loaded.config.max_position // page_size)
    memory = sizing.device_memory(device)
    pages = sizing.kv_pages_that_fit(memory, fraction, per_page, max_pages)
    one_request = -(-loaded.config.max_position // page_size)
    gib = sizing.GIB
    if pages < one_request:
        raise DoesNotFit(
            f"{device} has room for only {pages} KV pages of {page_size} tokens, fewer "
            f"than one {loaded.config.max_position}-token request needs ({one_request}): "
            f"{fraction:.3g} of {memory.total / gib:.1f} GiB, {memory.free / gib:.1f} GiB "
            f"free, {memory.used_here / gib:.2f} GiB of weights here. "
            + _remedy(role_name, raise_fraction=True)
        )
    log.info(
        "KV pool sized to %s: %.3g of its %.1f GiB, %.1f GiB free, %.2f GiB held here, "
        "%.1f GiB kept in reserve", device, fraction, memory.total / gib, memory.free / gib,
        memory.used_here / gib, sizing.RESERVE_BYTES / gib,
    )
    return pages


def _remedy(role_name: str, raise_fraction: bool = False) -> str:
    fraction = "raise" if raise_fraction else "lower"
    return (f"Set --kv-pages or {fraction} --gpu-memory-fraction (pdmesh up: "
            f"--{role_name}-kv-pages, --gpu-memory-fraction), or free the device.")


@contextmanager
def out_of_memory_at_start(role_name: str, device: str, stage: str) -> Iterator[None]:
    """Turn CUDA running out of memory at start into DoesNotFit naming the stage and the
    flags to change (a traceback wall would bury both)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        free = ""
        if sizing.is_cuda(device):
            free_bytes, total = torch.cuda.mem_get_info(torch.device(device))
            free = f" ({free_bytes / sizing.GIB:.1f} of {total / sizing.GIB:.1f} GiB free)"
        raise DoesNotFit(
            f"CUDA out of memory on {device}{free} {stage}. {_remedy(role_name)}"
        ) from e


@dataclass
class KvMember:
    role: int  # cpb.PREFILL or cpb.DECODE
    name: str
    loaded: LoadedModel
    pool: KvPool
    engine: Engine
    agent: KvAgent
    layout: cpb.KvLayout
    wire: KvWire
    peers: dict[str, Peer] = field(default_factory=dict)
    # Members of the opposite role refused at join: name -> (epoch, why).
    refused: dict[str, tuple[int, str]] = field(default_factory=dict)
    on_peer_lost: list[PeerListener] = field(default_factory=list)
    # Signs this decode's TransferInfo grants; a new key per process (libs/member/grant.py).
    grant_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    faults: Faults = field(default_factory=Faults)  # off unless named (libs/faults)
    pinned_after: float = TIMEOUTS.pinned_after  # seconds a live room may idle (status)
    stall_after: float | None = None  # seconds of busy without progress: unhealthy

    @classmethod
    def create(
        cls, role: int, name: str, model: str, device: str, num_pages: int | None,
        page_size: int, dtype: str = "float32", weights: str = "native",
        kv_transfer: str = "native", memory_fraction: float | None = None,
        max_rooms: int = 256, cuda_graphs: bool = True, prefix_cache: bool = True,
    ) -> KvMember:
        """``num_pages`` None: sized to the device (see pool_pages). Raises
        UnsupportedKvShape when the model's KV cannot travel as ``kv_transfer``, and
        DoesNotFit when CUDA memory runs out on the way."""
        role_name = _ROLE_NAMES[role]
        with out_of_memory_at_start(role_name, device, "loading the weights of " + model):
            loaded = load_model(
                model, device=device, dtype=getattr(torch, dtype), weights_format=weights
            )
        if num_pages is None:
            num_pages = pool_pages(role_name, loaded, device, page_size, kv_transfer,
                                   memory_fraction, max_rooms)
        per_page = bytes_per_page(loaded, page_size, kv_transfer)
        with out_of_memory_at_start(role_name, device,
                            "allocating the KV pool of " + sizing.describe(
                                num_pages, page_size, per_page)):
            pool = KvPool(
                loaded.config, num_pages, page_size, device=device, dtype=loaded.weights.dtype
            )
            wire = KvWire(kv_transfer, pool.tensor)
        log.info("KV pool: %s on %s", sizing.describe(num_pages, page_size, per_page), device)
        fingerprint = model_fingerprint(loaded)
        if prefix_cache:  # keyed by the weights: another model never shares a page
            pool.enable_prefix_cache(fingerprint)
        with out_of_memory_at_start(role_name, device, "building the engine"):
            engine = Engine(loaded.config, loaded.weights, pool,
                            cuda_graphs=None if cuda_graphs else False)
        agent = KvAgent(name, wire.region, wire.page_bytes)
        layout = cpb.KvLayout(
            model=fingerprint,
            dtype=str(pool.dtype).removeprefix("torch."),
            page_size=page_size,
            num_layers=loaded.config.n_layers,
            num_kv_heads=loaded.config.n_kv_heads,
            head_dim=loaded.config.head_dim,
            page_bytes=pool.page_bytes,
            transfer_format=wire.name,
            wire_page_bytes=wire.page_bytes,
        )
        return cls(role, name, loaded, pool, engine, agent, layout, wire)

    def capture_graphs(self, *, decode_batch: int = 0, prefill_tokens: int = 0) -> None:
        """Capture the engine's CUDA graphs now: decode for batches up to
        ``decode_batch``, prefill for packs up to ``prefill_tokens``. Done at start, so the
        first requests do not pay for it (and no page holds KV yet, which prefill capture
        needs), and a graph that does not fit stops the start (DoesNotFit, naming the
        flags) rather than a request. A no-op without graphs."""
        from libs.engine.graphs import GraphOutOfMemory

        started = time.perf_counter()
        try:
            if decode_batch:
                if buckets := self.engine.capture_decode_graphs(decode_batch):
                    log.info("decode graphs captured for batches of %s", buckets)
            if prefill_tokens:
                if shapes := self.engine.capture_prefill_graphs(prefill_tokens):
                    log.info("%d prefill graphs captured for packs of up to %d tokens "
                             "in %.1fs", len(shapes), prefill_tokens,
                             time.perf_counter() - started)
        except GraphOutOfMemory as e:
            raise DoesNotFit(str(e)) from None

    @property
    def peer_role(self) -> int:
        return cpb.DECODE if self.role == cpb.PREFILL else cpb.PREFILL

    def registration(self, address: str, http_address: str = "") -> bpb.Member:
        pool_layout = self.agent.layout()
        return bpb.Member(
            role=self.role,
            name=self.name,
            address=address,
            http_address=http_address,
            nixl_metadata=self.agent.metadata(),
            layout=self.layout,
            region=cpb.KvRegion(
                base_addr=pool_layout.base_addr,
                num_pages=pool_layout.num_pages,
                mem_type=pool_layout.mem_type,
                device_id=pool_layout.device_id,
            ),
            grant_key=self.grant_key if self.role == cpb.DECODE else b"",
        )

    def peer(self, ref: cpb.PeerRef) -> Peer | None:
        """The live peer with exactly this name and epoch (a stale epoch finds nothing)."""
        peer = self.peers.get(ref.name)
        if peer is None or peer.member.epoch != ref.epoch:
            return None
        return peer

    def why_not_peer(self, ref: cpb.PeerRef, role_name: str) -> str:
        """Why ``ref`` is not a live peer, for a typed refusal that names the cause."""
        refused = self.refused.get(ref.name)
        if refused is not None and refused[0] == ref.epoch:
            return (f"{role_name} {ref.name!r} epoch {ref.epoch} cannot exchange KV with "
                    f"{self.name!r}: {refused[1]}")
        return f"{role_name} {ref.name!r} epoch {ref.epoch} is not a live peer"

    def on_join(self, member: bpb.Member) -> None:
        if member.role != self.peer_role:
            return
        why = layout_mismatch(self.layout, member.layout)
        if why is not None:
            log.error("refusing peer %s: %s", member.name, why)
            self.refused[member.name] = (member.epoch, why)
            return
        self.refused.pop(member.name, None)
        if member.name in self.peers:
            self._drop(member.name)
        agent_name = self.agent.add_peer(member.nixl_metadata)
        layout = PoolLayout(
            base_addr=member.region.base_addr,
            page_bytes=member.layout.wire_page_bytes,
            num_pages=member.region.num_pages,
            mem_type=member.region.mem_type,
            device_id=member.region.device_id,
        )
        self.peers[member.name] = Peer(member, agent_name, layout)
        log.info("peer %s epoch %d added", member.name, member.epoch)

    def on_leave(self, member: bpb.Member, reason: str) -> None:
        refused = self.refused.get(member.name)
        if refused is not None and refused[0] == member.epoch:
            del self.refused[member.name]
        peer = self.peers.get(member.name)
        if peer is None or peer.member.epoch != member.epoch:
            return
        self._drop(member.name)
        for listener in self.on_peer_lost:
            listener(member, reason)

    def _drop(self, name: str) -> None:
        peer = self.peers.pop(name)
        try:
            self.agent.remove_peer(peer.agent_name)
        except Exception:
            log.exception("removing NIXL agent of %s failed", name)

