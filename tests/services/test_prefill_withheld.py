"""Withheld pages come back once their writes are fenced late (a write over a lossy link
that missed its fence, then finished), and never before: services/prefill/service.py
(_reclaim_withheld). Found by the namespace fault harness: with 20% loss on the KV link
a prefill kept 8 pages for the rest of its life (docs/faults.md)."""

from __future__ import annotations

from types import SimpleNamespace

import anyio

from services.prefill.service import PrefillService, Withheld


class SlowWrite:
    """A write NIXL will not cancel while it runs (release refused), then DONE."""

    def __init__(self) -> None:
        self.finished = False
        self.released = False
        self.bytes = 4096
        self.error = ""

    def poll(self) -> str:
        return "DONE" if self.finished else "PROC"

    def release(self) -> bool:
        if not self.finished:
            return False
        self.released = True
        return True


class Pool:
    def __init__(self) -> None:
        self.freed: list[list[int]] = []

    def free(self, pages) -> None:
        self.freed.append(list(pages))


async def test_withheld_pages_are_freed_only_once_every_write_is_fenced():
    writes = [SlowWrite(), SlowWrite()]
    pool = Pool()
    service = SimpleNamespace(withheld=[Withheld("room", [3, 4, 5], writes)],
                              member=SimpleNamespace(pool=pool))
    async with anyio.create_task_group() as tg:
        tg.start_soon(PrefillService._reclaim_withheld, service, 0.01)
        await anyio.sleep(0.1)
        assert pool.freed == [] and len(service.withheld) == 1  # a write may still read
        writes[0].finished = True
        await anyio.sleep(0.1)
        assert pool.freed == []  # one of two fenced is not enough
        writes[1].finished = True
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    assert pool.freed == [[3, 4, 5]] and service.withheld == []  # freed once
    assert all(w.released for w in writes)
