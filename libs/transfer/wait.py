"""Async completion wait: NIXL has no asyncio integration and no stall timeout.

The application owns the deadline (nixl#2047: a handle can stay PROC forever when the peer
vanishes). Polling starts at every turn of the event loop, because a GPU write of a
chunk's pages finishes in microseconds and a timer cannot wait less than a millisecond on
asyncio or uvloop; after ``SPIN_S`` it backs off so a long transfer costs the loop about
one check per millisecond.
"""

from __future__ import annotations

import time

import anyio

from libs.transfer.agent import Transfer
from libs.transfer.errors import TransferFailed, TransferTimeout

SPIN_S = 200e-6
FIRST_SLEEP_S = 50e-6
MAX_SLEEP_S = 1e-3


async def wait(transfer: Transfer, deadline: float) -> None:
    """Return when ``transfer`` is DONE; raise TransferFailed on ERR, TransferTimeout once
    ``time.monotonic()`` passes ``deadline``. Does not release the handle (see Transfer)."""
    spin_until = time.monotonic() + SPIN_S
    delay = FIRST_SLEEP_S
    while True:
        state = transfer.poll()
        if state == "DONE":
            return
        if state == "ERR":
            raise TransferFailed(transfer.error or "backend reported ERR")
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            raise TransferTimeout(f"transfer of {transfer.bytes} bytes still in progress")
        if now < spin_until:
            await anyio.sleep(0)  # one turn of the loop: other tasks and I/O run
            continue
        await anyio.sleep(min(delay, remaining))
        delay = min(delay * 2, MAX_SLEEP_S)
