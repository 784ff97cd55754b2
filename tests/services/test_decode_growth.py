"""KV reserved as it is used: the grow/preempt accounting, the batch that preempts, and the
continuation that samples what an unpreempted run samples."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import anyio
import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.engine import Engine
from libs.engine.generate import generate
from libs.engine.kvpool import KvPool
from libs.engine.model import random_weights
from libs.engine.sampling import SamplingParams, sample
from services.decode.batcher import Batcher
from services.decode.growth import Reservation, grow, pages_short
from services.router.resume import continuation

PAGE = 4


@dataclass(eq=False)
class Seq:
    prompt_len: int
    order: int
    generated: int = 1  # the prefill's first token
    ahead: int = 0
    pages: list[int] = field(default_factory=list)


def pool_of(pages: int) -> KvPool:
    return KvPool(ModelConfig.tiny(), pages, PAGE)


def admitted(pool: KvPool, prompt_len: int, order: int) -> Seq:
    seq = Seq(prompt_len, order)
    seq.pages = pool.alloc(pool.pages_for(prompt_len + 1))
    return seq


def test_a_growing_sequence_takes_the_newest_ones_pages_and_nothing_leaks():
    pool = pool_of(6)
    old, mid, new = (admitted(pool, 4, order) for order in range(3))  # 2 pages each
    assert pool.free_count == 0
    old.generated = mid.generated = 5  # positions 4..8: a third page each
    preempted = grow(pool, [old, mid], [new])
    assert preempted == [new]  # the newest, though it does not step yet
    assert new.pages == []
    assert len(old.pages) == len(mid.pages) == 3
    assert pool.used == len(old.pages) + len(mid.pages) == 6
    old.generated = 9  # a fourth page for the oldest: the next newest goes
    assert grow(pool, [old, mid]) == [mid]
    assert (len(old.pages), mid.pages, pool.free_count) == (4, [], 2)


def test_the_newest_sequence_preempts_itself_rather_than_an_older_one():
    pool = pool_of(4)
    old, new = admitted(pool, 4, 0), admitted(pool, 4, 1)
    new.generated = 5
    assert grow(pool, [old, new]) == [new]
    assert old.pages and pool.used == len(old.pages) == 2


def test_random_growth_never_leaks_a_page_and_always_preempts_the_newest():
    rng = random.Random(7)
    pool = pool_of(40)
    live: list[Seq] = []
    order = 0
    for _ in range(400):
        if rng.random() < 0.3 and pool.free_count >= 3:
            live.append(admitted(pool, rng.randint(1, 8), order))
            order += 1
        for seq in live:
            seq.generated += 1
        running = live[: rng.randint(0, len(live))]
        waiting = live[len(running):]
        newest_first = sorted(live, key=lambda s: -s.order)
        preempted = grow(pool, running, waiting)
        assert preempted == newest_first[: len(preempted)]
        assert all(s.pages == [] for s in preempted)
        live = [s for s in live if s not in preempted]
        assert all(pages_short(pool, s) == 0 for s in running if s in live)
        for seq in [s for s in live if s.generated > rng.randint(5, 60)]:  # finishes
            pool.free(seq.pages)
            live.remove(seq)
        held = [p for s in live for p in s.pages]
        assert len(held) == len(set(held)) == pool.used  # no page twice, none leaked
    for seq in live:
        pool.free(seq.pages)
    assert pool.used == 0


def test_the_reservation_is_the_prompt_plus_a_margin_or_everything_up_front():
    assert Reservation().admit_tokens(100, 1024) == 116
    assert Reservation(growth_tokens=64).admit_tokens(100, 8) == 108  # never past max_tokens
    assert Reservation("upfront").admit_tokens(100, 1024) == 1124
    with pytest.raises(ValueError):
        Reservation("lazy")
    with pytest.raises(ValueError):
        Reservation(growth_tokens=0)


@pytest.fixture(scope="module")
def engine_maker():
    """A random model whose tokens depend on the context and the seed: tiny's tied,
    unit-scale embedding repeats one token whatever it is given, which would hide a wrong
    page or a wrong sampling step; an untied head over a small vocabulary does not."""
    config = dataclasses.replace(ModelConfig.tiny(), vocab_size=512, tie_embeddings=False)
    weights = random_weights(config, seed=3)
    weights.lm_head = weights.lm_head * 8
    weights = weights.to("cpu", torch.float32)
    return lambda pages: Engine(config, weights, KvPool(config, pages, PAGE))


def prefilled(engine: Engine, prompt: list[int], params: SamplingParams, reserve: int):
    pages = engine.pool.alloc(engine.pool.pages_for(len(prompt) + reserve))
    return pages, sample(engine.prefill(prompt, pages), params, params.start_step)


PROMPTS = [list(range(5 + i, 17 + i)) for i in range(3)]  # 12 tokens: 3 pages each
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
async def test_the_batch_preempts_the_newest_and_its_continuation_samples_the_same_tokens(
    engine_maker, overlap,
):
    """Three seeded sequences whose whole lengths need 24 pages share 16: the batch grows
    them step by step and preempts the newest; the others finish with the tokens they
    sample alone, and the preempted one's continuation (prompt + its streamed tokens,
    start_step = their count, on a fresh pool) completes exactly its unpreempted stream.
    With overlap, the preemption waits until no step is on the device."""
    alone_engine = engine_maker(64)
    alone = [generate(alone_engine, p, SEEDED) for p in PROMPTS]
    assert len({t for tokens in alone for t in tokens}) > 20  # the check can tell

    engine = engine_maker(16)
    batcher = Batcher(engine, eos_token_ids=[], overlap=overlap)
    out: list[tuple[list[int], str | None]] = []

    async def run_all():
        seqs = []
        for prompt in PROMPTS:
            pages, first = prefilled(engine, prompt, SEEDED, 1)
            seqs.append(batcher.admit(pages, len(prompt), first, SEEDED))
        for seq in seqs:
            with seq.tokens.reading():
                items = [item async for item in seq.tokens]
            await seq.released.wait()
            engine.pool.free(seq.pages)  # what the owner's release frees
            out.append(([i.token for i in items if i.token >= 0], items[-1].finish_reason))

    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        with anyio.fail_after(30):
            await run_all()
        tg.cancel_scope.cancel()

    assert engine.pool.used == 0  # nothing leaked, preempted pages included
    assert [reason for _, reason in out] == ["length", "length", "preempted"]
    assert batcher.preemptions == 1
    assert [tokens for tokens, _ in out[:2]] == alone[:2]
    streamed = out[2][0]
    assert 0 < len(streamed) < SEEDED.max_tokens
    assert streamed == alone[2][: len(streamed)]

    rest_prompt, rest = continuation(PROMPTS[2], sampling_proto(SEEDED), streamed)
    assert rest.start_step == len(streamed) and rest.max_tokens == 20 - len(streamed)
    params = SamplingParams(temperature=rest.temperature, top_p=rest.top_p, seed=rest.seed,
                            max_tokens=rest.max_tokens, ignore_eos=True,
                            start_step=rest.start_step)
    fresh = engine_maker(64)
    batcher = Batcher(fresh, eos_token_ids=[], overlap=overlap)
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        pages, first = prefilled(fresh, rest_prompt, params, params.max_tokens)
        seq = batcher.admit(pages, len(rest_prompt), first, params)
        with anyio.fail_after(30):
            with seq.tokens.reading():
                tail = [item.token async for item in seq.tokens]
        tg.cancel_scope.cancel()
    assert streamed + tail == alone[2]


def sampling_proto(params: SamplingParams):
    from pdmesh.v1 import common_pb2 as cpb

    return cpb.SamplingParams(temperature=params.temperature, top_p=params.top_p,
                              seed=params.seed, max_tokens=params.max_tokens,
                              ignore_eos=params.ignore_eos)
