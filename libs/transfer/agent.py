"""KvAgent: one NIXL agent per prefill/decode process, owning the registered KV pool.

Threading: NIXL agents are not thread-safe in the mode we create them (no listener thread,
``NIXL_THREAD_SYNC_NONE``). Exactly one owner calls into a KvAgent: the process's event
loop thread. Every method here is synchronous and fast (no blocking waits); completion is
polled by :func:`libs.transfer.wait.wait` with short sleeps, so the loop never blocks.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from nixl import _bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_xfer_handle

from libs.transfer.errors import (
    BackendUnavailable,
    LayoutMismatch,
    PeerExists,
    TransferFailed,
    UnknownPeer,
)
from libs.transfer.layout import PageIds, PoolLayout, plan

log = logging.getLogger(__name__)

NOTIF_ERROR_LOG_EVERY_S = 5.0  # a failing notification poll logs at most this often

# NIXL's bindings raise one exception class per status code, with no common base.
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")
)


def settle(device: torch.device) -> None:
    """Return once ``device`` has run every kernel queued on it so far (no-op on a CPU).

    UCX reads a GPU pool on its own CUDA stream, which torch's stream order does not
    cover: whoever wrote pages calls this before a write of them is posted. Called from
    a worker thread (the prefill's compute thread, a staging pack), never from the loop.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Transfer:
    """Handle of one posted WRITE. Terminal poll results are cached: NIXL is not asked twice.

    ``seconds`` runs from just before the post to the first poll that saw DONE (the post
    itself when it finished the write, as a CMA write on one host does). Completion is
    only seen when someone polls, so a write left in flight while its owner computes is
    timed up to that owner's next poll.
    """

    def __init__(self, handle: nixl_xfer_handle, agent: nixl_agent, first: str, size: int,
                 descs: int, live: set[Transfer], posted: float | None = None) -> None:
        self._handle = handle
        self._agent = agent
        self._live = live  # the owner's unreleased handles: this one until it is released
        live.add(self)
        self.posted = time.perf_counter() if posted is None else posted
        self.seconds: float | None = None  # post to DONE, once a poll saw it
        self._state = ""
        self._record(first)
        self.bytes = size
        self.descriptors = descs
        self.released = False
        self.withheld = False  # its owner gave up fencing it and keeps its pages (not a leak)
        self.error = ""  # why the backend ended it in ERR, when it said

    @property
    def gbps(self) -> float | None:
        """Bytes per nanosecond (GB/s) from post to DONE; None until DONE was seen."""
        if not self.seconds:
            return None
        return self.bytes / self.seconds / 1e9

    def _record(self, state: str) -> None:
        if state == "DONE" and self._state != "DONE":
            self.seconds = time.perf_counter() - self.posted
        self._state = state

    def poll(self) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``; never raises.

        NIXL reports some failures by raising instead of answering ERR (a peer killed
        while a write is in flight raises NIXL_ERR_REMOTE_DISCONNECT). Both mean the same
        to the caller, so both are ERR here: an exception escaping a poll once skipped a
        prefill's release and kept the room and its pages forever.
        """
        if self._state == "PROC" and not self.released:
            try:
                self._record(self._agent.check_xfer_state(self._handle))
            except NIXL_ERRORS as exc:
                self._state = "ERR"
                self.error = f"{type(exc).__name__}: {exc}"
        return self._state

    def release(self) -> bool:
        """Free the handle; True once released.

        On a transfer still in flight NIXL tries to cancel and may refuse: then this returns
        False and the caller must keep the destination pages fenced (quarantined).
        """
        if self.released:
            return True
        try:
            self._handle.release()
        except NIXL_ERRORS as exc:
            log.warning("release of in-flight transfer refused: %s", exc)
            return False
        self.released = True
        self._live.discard(self)
        return True


class Notified:
    """A notification sent on its own, no data: what a room whose pages the peer holds
    already "writes". Done when posted; it holds no memory, so it is always fenced."""

    bytes = 0
    descriptors = 0
    gbps = None
    released = True
    withheld = False
    error = ""

    def poll(self) -> str:
        return "DONE"

    def release(self) -> bool:
        return True


class KvAgent:
    """Registers a page-major pool once and WRITEs pages into peers' pools.

    ``progress_thread`` defaults to off: NIXL's progress thread busy-polls a core, which on
    a small host halved both transfer and memcpy throughput in pdmesh/bench/transfer.py.
    Without it, UCX progresses when the owner calls in, so both sides must keep polling:
    the writer through :func:`libs.transfer.wait.wait`, the reader through
    :meth:`get_notifs` (about every millisecond while it expects pages).
    ``backend_params`` are UCX init params (e.g. ``ucx_error_handling_mode``; the default
    "peer" mode is what turns a vanished peer into ERR instead of a hang).
    """

    def __init__(
        self,
        name: str,
        pool_tensor: torch.Tensor,
        page_bytes: int,
        *,
        backend_params: dict[str, str] | None = None,
        progress_thread: bool = False,
    ) -> None:
        if not pool_tensor.is_contiguous():
            raise LayoutMismatch("pool tensor must be contiguous")
        total = pool_tensor.numel() * pool_tensor.element_size()
        if page_bytes <= 0 or total % page_bytes:
            raise LayoutMismatch(f"pool of {total} bytes is not a whole number of pages")
        self.name = name
        self._pool = pool_tensor  # keep the registered memory alive
        device = pool_tensor.get_device()
        self._layout = PoolLayout(
            base_addr=pool_tensor.data_ptr(),
            page_bytes=page_bytes,
            num_pages=total // page_bytes,
            mem_type="DRAM" if device < 0 else "VRAM",
            device_id=max(device, 0),
        )
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._agent = nixl_agent(name, config)
        try:
            self._agent.create_backend("UCX", backend_params or {})
        except NIXL_ERRORS as exc:
            chosen = ", ".join(f"{k}={os.environ[k]}" for k in ("UCX_TLS", "UCX_NET_DEVICES")
                               if k in os.environ) or "UCX defaults"
            raise BackendUnavailable(f"the UCX backend did not start with {chosen} "
                                     f"({type(exc).__name__})") from None
        self._reg = self._agent.register_memory(pool_tensor)
        self._peers: set[str] = set()
        self._live: set[Transfer] = set()  # posted writes whose handles are not released
        self._notif_errors = 0
        self._notif_error_logged = -NOTIF_ERROR_LOG_EVERY_S

    def metadata(self) -> bytes:
        """Agent metadata (connection info and the registered pool) to publish to peers."""
        return self._agent.get_agent_metadata()

    def layout(self) -> PoolLayout:
        """What a peer needs to address this pool's pages."""
        return self._layout

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    @property
    def unreleased(self) -> int:
        """Posted writes whose handles are not released yet (in flight, or never fenced)."""
        return len(self._live)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name.

        A name already present is refused: a restarted peer's old agent must be removed
        first (and its rooms failed), so nothing keeps using stale endpoints or keys.
        """
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except _bindings.nixlNotAllowedError as exc:
            # NIXL refuses new metadata under a name it already holds.
            raise PeerExists("peer name already added; remove_peer first") from exc
        except NIXL_ERRORS as exc:
            raise TransferFailed(f"add_remote_agent: {type(exc).__name__}: {exc}") from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name in self._peers:
            # Reloading identical metadata is a no-op in NIXL; still refuse, to keep one path.
            raise PeerExists(f"peer {name} already added; remove_peer first")
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Drop a peer's agent (disconnects). Idempotent."""
        if name not in self._peers:
            return
        self._peers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except NIXL_ERRORS as exc:
            log.warning("remove_remote_agent(%s) failed: %s", name, exc)

    def write_pages(
        self,
        peer_name: str,
        peer_layout: PoolLayout,
        src_pages: PageIds,
        dst_pages: PageIds,
        notif: bytes | None = None,
    ) -> Transfer:
        """Post ONE WRITE of local ``src_pages`` into the peer's ``dst_pages``.

        Page pairs consecutive on both sides merge into one descriptor, so a request whose
        pages are one run on each side moves as one. ``notif`` is delivered to the peer
        after the data of this WRITE. Raises LayoutMismatch, UnknownPeer, or
        TransferFailed if NIXL refuses the request.

        A GPU pool is read by UCX on its own CUDA stream, outside torch's stream order:
        the kernels that wrote ``src_pages`` must have finished before this call
        (:func:`settle`).
        """
        if peer_name not in self._peers:
            raise UnknownPeer(peer_name)
        posted = time.perf_counter()
        write = plan(self._layout, peer_layout, src_pages, dst_pages)
        try:
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(write.local, self._layout.mem_type),
                self._agent.get_xfer_descs(write.remote, peer_layout.mem_type),
                peer_name,
                notif or b"",
            )
        except NIXL_ERRORS as exc:
            raise TransferFailed(f"{type(exc).__name__}: {exc}") from exc
        try:
            first = self._agent.transfer(handle)
        except NIXL_ERRORS as exc:
            # A peer found gone at post time: the handle was created, so free it here, or
            # UCX keeps its request and can abort the process at exit.
            try:
                handle.release()
            except NIXL_ERRORS as again:
                log.warning("release after a failed post refused: %s", again)
            raise TransferFailed(f"{type(exc).__name__}: {exc}") from exc
        size = write.pages * self._layout.page_bytes
        return Transfer(handle, self._agent, first, size, write.descriptors, self._live, posted)

    def notify(self, peer_name: str, notif: bytes) -> Notified:
        """Send ``notif`` to the peer without a WRITE. Delivered after the data of the
        writes posted before it that the caller saw DONE."""
        if peer_name not in self._peers:
            raise UnknownPeer(peer_name)
        try:
            self._agent.send_notif(peer_name, notif)
        except NIXL_ERRORS as exc:
            raise TransferFailed(f"{type(exc).__name__}: {exc}") from exc
        return Notified()

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """New notifications since the last call, as (peer agent name, message).

        A NIXL error here (a peer vanishing mid-progress) yields none: the caller is the
        decode's one notification loop, which must outlive any peer; the rooms waiting on
        that peer fail by membership or deadline.
        """
        try:
            notifs = self._agent.get_new_notifs()
        except NIXL_ERRORS as exc:
            self._notif_errors += 1
            now = time.monotonic()
            if now - self._notif_error_logged >= NOTIF_ERROR_LOG_EVERY_S:  # polled ~1 kHz
                log.warning("get_new_notifs failed (%d times so far): %s: %s",
                            self._notif_errors, type(exc).__name__, exc)
                self._notif_error_logged = now
            return []
        return [(peer, msg) for peer, msgs in notifs.items() for msg in msgs]

    def close(self) -> int:
        """Release what is still held, drop peers, deregister the pool; call once, from the
        owner, at shutdown. Returns how many transfer handles were still unreleased.

        Every write a service posts is fenced and released before its pages are reused, so
        a handle left here is a leak unless its owner marked it ``withheld`` (a fence that
        never came: the pages were kept out of use instead). Counting leaks here, not at
        interpreter exit (where UCX aborts the process over a leaked request), lets a clean
        stop say so and lets the process end without that teardown."""
        leaked = sum(not t.withheld for t in self._live)
        withheld = len(self._live) - leaked
        if withheld:
            log.warning("%d transfers were withheld unfenced; releasing them at close",
                        withheld)
        for transfer in list(self._live):
            transfer.release()
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self._agent.deregister_memory(self._reg)
        except NIXL_ERRORS as exc:
            log.warning("deregister_memory failed: %s", exc)
        return leaked
