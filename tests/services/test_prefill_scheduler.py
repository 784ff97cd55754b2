"""The prefill scheduler alone, over a small real engine: packing, cancellation, errors."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

from services.prefill.scheduler import PrefillScheduler
from tests.engine.conftest import make_engine


async def test_concurrent_chunks_share_one_forward_and_match_alone():
    engine = make_engine()
    scheduler = PrefillScheduler(engine, max_batch_tokens=64)
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    pages = [engine.pool.alloc(2) for _ in prompts]
    results = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)

        async def one(i):
            results[i] = await scheduler.prefill(prompts[i], pages[i], 0)

        async with anyio.create_task_group() as requests:
            for i in range(3):
                requests.start_soon(one, i)
        tg.cancel_scope.cancel()
    assert scheduler.forwards == 1  # 3 x 20 tokens fit one 64-token pack
    for i, prompt in enumerate(prompts):
        alone = make_engine()
        own = alone.pool.alloc(2)
        torch.testing.assert_close(results[i], alone.prefill(prompt, own, 0))


async def test_budget_splits_packs():
    engine = make_engine()
    scheduler = PrefillScheduler(engine, max_batch_tokens=32)
    pages = [engine.pool.alloc(2) for _ in range(3)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        async with anyio.create_task_group() as requests:
            for i in range(3):
                requests.start_soon(scheduler.prefill, list(range(20)), pages[i], 0)
        tg.cancel_scope.cancel()
    assert scheduler.forwards == 3


async def test_cancelled_caller_waits_for_its_running_chunk():
    """Its pages are written by the running forward: returning earlier would free them."""
    engine = make_engine()
    started, release = threading.Event(), threading.Event()
    real = engine.prefill_batch

    def slow(seqs, should_stop=None):  # ignores should_stop: a pass that cannot stop early
        started.set()
        release.wait(5)
        return real(seqs)

    engine.prefill_batch = slow
    scheduler = PrefillScheduler(engine)
    pages = engine.pool.alloc(2)
    released_at: list[float] = []

    async def release_later():
        await anyio.sleep(0.5)
        released_at.append(time.monotonic())
        release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        tg.start_soon(release_later)
        with anyio.move_on_after(0.2):
            await scheduler.prefill(list(range(20)), pages, 0)
        returned_at = time.monotonic()
        tg.cancel_scope.cancel()
    assert started.is_set()
    assert released_at and returned_at >= released_at[0]


async def test_a_failing_forward_fails_its_chunks_and_the_loop_lives():
    engine = make_engine()
    real = engine.prefill_batch
    calls = []

    def flaky(seqs, should_stop=None):
        calls.append(len(seqs))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(seqs, should_stop)

    engine.prefill_batch = flaky
    scheduler = PrefillScheduler(engine)
    pages = engine.pool.alloc(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        with pytest.raises(RuntimeError, match="boom"):
            await scheduler.prefill(list(range(20)), pages, 0)
        logits = await scheduler.prefill(list(range(20)), pages, 0)
        tg.cancel_scope.cancel()
    assert logits.shape[-1] == engine.config.vocab_size


async def test_queued_work_without_progress_reports_a_stall():
    scheduler = PrefillScheduler(make_engine())  # its loop is deliberately not running
    assert not scheduler.stalled(after=0.0)  # nothing queued: idle is not a stall
    pages = scheduler.engine.pool.alloc(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.prefill, list(range(20)), pages, 0)
        await anyio.sleep(0.05)
        assert not scheduler.stalled(after=10.0)
        scheduler.last_progress -= 11.0
        assert scheduler.stalled(after=10.0)
        tg.cancel_scope.cancel()


async def test_a_pass_whose_callers_all_left_stops_early():
    """W1: the real engine checks should_stop between layers; cancelling the only caller of
    a running pass ends it at the next layer instead of after the whole forward."""
    engine = make_engine()
    real = engine.prefill_batch
    entered = threading.Event()

    def gated(seqs, should_stop=None):
        entered.set()
        while not should_stop():  # stands in for a long forward: only a stop ends it
            time.sleep(0.001)
        return real(seqs, should_stop)  # the real engine then stops before layer 0

    engine.prefill_batch = gated
    scheduler = PrefillScheduler(engine)
    pages = engine.pool.alloc(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        t0 = time.monotonic()
        with anyio.move_on_after(0.2):
            await scheduler.prefill(list(range(20)), pages, 0)
        elapsed = time.monotonic() - t0
        tg.cancel_scope.cancel()
    assert entered.is_set() and scheduler.stopped_early == 1
    assert elapsed < 1.0
