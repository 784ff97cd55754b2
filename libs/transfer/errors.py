"""Typed transfer errors: the application, not NIXL, decides what a failure means."""

from __future__ import annotations


class TransferError(Exception):
    """Base of every transfer error."""


class TransferFailed(TransferError):
    """NIXL reported ERR, or refused to create/post the request. ``reason`` is short text."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TransferTimeout(TransferError):
    """The transfer was still in progress at its deadline.

    Not a fence: a write may still land. Keep the destination pages quarantined until the
    handle is released successfully or the peer's registration is dropped.
    """


class UnknownPeer(TransferError, KeyError):
    """A write named a peer agent that is not (or no longer) added."""


class PeerExists(TransferError):
    """``add_peer`` for a name already present; remove the old agent first (restart fence)."""


class LayoutMismatch(TransferError, ValueError):
    """Page ids or page sizes that do not fit the local or peer pool layout."""


class BackendUnavailable(TransferError):
    """UCX did not start with this process's settings (UCX_TLS / UCX_NET_DEVICES naming a
    transport or device this host lacks): the member cannot serve, and restarting it with
    the same settings would fail the same way."""
