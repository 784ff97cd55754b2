"""The decode's batch loop and its token streams, with a fake engine and tokenizer.

The step loop samples the whole batch at once and hands ids to each sequence's stream;
the stream detokenizes and applies stop strings; a reader that falls behind gets several
tokens a chunk, with the same tokens, text, finish reason and count as one that keeps up.
"""

from __future__ import annotations

import time

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
from services.decode.stream import Chunk, TokenStream

VOCAB = 64
EOS = 2


class FakeEngine:
    """Logits that depend only on (position, token): the next token of a greedy row is
    `(token + 1) % VOCAB`, skipping EOS unless a row's position says otherwise."""

    device = "cpu"

    def __init__(self, eos_at: int | None = None, boost: float = 20.0):
        # Pages the batch grows sequences into (the fake steps never read them); large
        # enough that no test here preempts (tests/services/test_decode_growth.py does).
        self.pool = KvPool(ModelConfig.tiny(), 256, 16)
        self.eos_at = eos_at
        self.boost = boost
        self.batch_sizes: list[int] = []

    def logits_for(self, pos: int, token: int) -> torch.Tensor:
        row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(pos * 1000 + token))
        nxt = EOS if pos == self.eos_at else (token + 1) % VOCAB
        nxt = nxt + 1 if nxt == EOS and pos != self.eos_at else nxt
        row[nxt] += self.boost
        return row

    def decode_step(self, batch, copy=True, fed=None) -> torch.Tensor:
        self.batch_sizes.append(len(batch))
        tokens = [int(fed[-1 - s.token]) if s.token < 0 else s.token for s in batch]
        return torch.stack([self.logits_for(s.pos, t) for s, t in zip(batch, tokens, strict=True)])


class SlowEngine(FakeEngine):
    """A step that takes `seconds` on the compute thread, as a GPU step does."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def decode_step(self, batch, copy=True, fed=None) -> torch.Tensor:
        time.sleep(self.seconds)
        return super().decode_step(batch, copy, fed)


class FakeTokenizer:
    eos_token_ids = (EOS,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"w{i} " for i in ids if not (skip_special_tokens and i == EOS))


async def run_sequence(batcher: Batcher, params: SamplingParams, pause: float = 0.0,
                       first_token: int = 10, prompt_len: int = 5, stop_sequence=None,
                       pace: float = 0.0, times: list[float] | None = None):
    """Admit one sequence and read its stream to the end; `pause` between reads, `pace`
    the stream's own least time between messages; `times` gets each chunk's arrival."""
    seq = batcher.admit(list(range(8)), prompt_len, first_token, params)
    stream = TokenStream(seq, FakeTokenizer(), stop_sequence or batcher.cancel, lambda: pace)
    chunks: list[Chunk] = []
    with seq.tokens.reading():
        while True:
            chunk = await stream.next()
            chunks.append(chunk)
            if times is not None:
                times.append(time.monotonic())
            if chunk.finish_reason is not None:
                break
            await anyio.sleep(pause)
    with anyio.fail_after(2):
        await seq.released.wait()  # out of the batch: its pages may be freed
    return seq, stream, chunks


def joined(chunks: list[Chunk]) -> tuple[list[int], str]:
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


OVERLAP = False  # set by the `overlap` fixture: every test runs both ways


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap(request, monkeypatch):
    """Each test runs with steps one after the other, and with each step launched
    before the one before it is handed off (`--overlap-steps on`)."""
    monkeypatch.setattr(f"{__name__}.OVERLAP", request.param)
    return request.param


async def with_batcher(engine, body):
    batcher = Batcher(engine, FakeTokenizer.eos_token_ids, max_batch=16, overlap=OVERLAP)
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        try:
            return await body(batcher)
        finally:
            tg.cancel_scope.cancel()


async def test_a_slow_reader_gets_fewer_chunks_with_the_same_tokens_and_text():
    params = SamplingParams(temperature=0, max_tokens=40)

    async def read(pause):
        return await with_batcher(FakeEngine(), lambda b: run_sequence(b, params, pause))

    _, fast_stream, fast = await read(0.0)
    _, slow_stream, slow = await read(0.05)
    assert joined(slow) == joined(fast)
    ids, text = joined(fast)
    assert ids == [10 + i for i in range(40)]
    assert text == "".join(f"w{i} " for i in ids)
    assert len(slow) < 40 / 3  # several tokens a message
    assert len(fast) > len(slow)
    for chunks, stream in ((fast, fast_stream), (slow, slow_stream)):
        assert chunks[-1].finish_reason == "length"
        assert stream.completion_tokens == 40
        assert all(c.finish_reason is None for c in chunks[:-1])


async def test_a_paced_stream_sends_the_tokens_sampled_meanwhile_in_one_message():
    """A reader that keeps up still waits out its pace between messages: the first token
    goes out at once, later messages are at least the pace apart and carry every token
    sampled meanwhile; tokens, text and finish equal an unpaced stream's."""
    params = SamplingParams(temperature=0, max_tokens=40)

    async def read(pace, times=None):
        return await with_batcher(
            SlowEngine(0.002), lambda b: run_sequence(b, params, pace=pace, times=times))

    times: list[float] = []
    _, _, unpaced = await read(0.0)
    _, stream, paced = await read(0.03, times)
    assert joined(paced) == joined(unpaced)
    assert len(paced[0].token_ids) == 1  # the first message does not wait
    assert len(paced) <= (times[-1] - times[0]) / 0.03 + 2
    assert len(paced) < len(unpaced) / 3
    assert all(b - a >= 0.029 for a, b in zip(times, times[1:], strict=False))
    assert max(len(c.token_ids) for c in paced) > 3
    assert paced[-1].finish_reason == "length" and stream.completion_tokens == 40


async def read_until_stop_string(pause: float):
    """A sequence stopped by "w15"; the number of steps run when the reader stopped it."""
    engine = FakeEngine()
    steps_at_stop = []

    async def body(batcher):
        def stop(seq):
            steps_at_stop.append(len(engine.batch_sizes))
            batcher.cancel(seq)

        params = SamplingParams(temperature=0, max_tokens=500, stop=["w15"])
        return batcher, *await run_sequence(batcher, params, pause, stop_sequence=stop)

    result = await with_batcher(engine, body)
    return engine, steps_at_stop[0], *result


async def test_stop_string_ends_the_sequence_and_releases_it():
    """The text stops before the stop string, the count includes the token that completed
    it, and the sequence leaves the batch within a step of the reader seeing it; a slow
    reader agrees."""
    for pause in (0.0, 0.02):
        engine, steps_at_stop, batcher, seq, stream, chunks = await read_until_stop_string(pause)
        ids, text = joined(chunks)
        assert ids == [10, 11, 12, 13, 14, 15]
        assert text == "w10 w11 w12 w13 w14 "
        assert chunks[-1].finish_reason == "stop" and stream.completion_tokens == 6
        assert seq.cancelled and seq.finished and not batcher.running
        assert len(engine.batch_sizes) <= steps_at_stop + 1  # the step in progress


async def test_eos_and_stop_tokens_end_with_no_text_of_their_own():
    engine = FakeEngine(eos_at=9)  # position 9: the 5th decode step samples EOS

    async def body(batcher):
        eos = await run_sequence(batcher, SamplingParams(temperature=0, max_tokens=50))
        stop = await run_sequence(
            batcher, SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[13])
        )
        ignored = await run_sequence(
            batcher, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        return eos, stop, ignored

    eos, stop, ignored = await with_batcher(engine, body)
    assert joined(eos[2]) == ([10, 11, 12, 13, 14, EOS], "w10 w11 w12 w13 w14 ")
    assert eos[2][-1].finish_reason == "stop" and eos[1].completion_tokens == 6
    assert joined(stop[2]) == ([10, 11, 12, 13], "w10 w11 w12 ")
    assert stop[2][-1].finish_reason == "stop" and stop[1].completion_tokens == 4
    assert joined(ignored[2])[0] == [10, 11, 12, 13, 14, EOS, 3, 4]
    assert ignored[2][-1].finish_reason == "length"


async def test_a_sequence_that_ends_under_a_launched_step_is_released_after_it(overlap):
    """With overlap, the step after a sequence's EOS is launched before the EOS reaches
    the host: that step still writes the sequence's KV, so the sequence is released only
    once the batch has handed that step off, and the token it sampled is dropped. Serial,
    the sequence is released as its EOS is handed off."""
    engine = FakeEngine(eos_at=9)  # the 5th decode step of a 5-token prompt samples EOS
    seen: list[tuple[int, bool]] = []  # per launch: rows, whether `ended` is released
    step = engine.decode_step

    def recording(batch, copy=True, fed=None):
        seen.append((len(batch), ended[0].released.is_set() if ended else False))
        return step(batch, copy, fed)

    engine.decode_step = recording
    ended: list = []

    async def body(batcher):
        longer = batcher.admit(list(range(8)), 20, 10, SamplingParams(temperature=0,
                                                                      max_tokens=12))
        ended.append(batcher.admit(list(range(8, 16)), 5, 10,
                                   SamplingParams(temperature=0, max_tokens=50)))
        for seq in (ended[0], longer):
            with seq.tokens.reading():
                items = [item async for item in seq.tokens]
            with anyio.fail_after(2):
                await seq.released.wait()
        return items

    await with_batcher(engine, body)
    two_rows = [released for rows, released in seen if rows == 2]
    one_row = [released for rows, released in seen if rows == 1]
    assert not any(two_rows)
    # EOS came from the 5th step; with overlap a 6th was already launched with both rows
    assert len(two_rows) == (6 if overlap else 5)
    # the launch after that still holds the ended sequence's step: not yet released
    assert one_row[0] is (not overlap)
    assert all(one_row[1:]) and len(seen) == 11  # `longer`'s 11 decode tokens


async def test_a_failed_step_ends_its_sequences_with_an_error_and_the_loop_lives_on():
    """The 4th step raises: both sequences in the batch (one of them in the step before,
    with overlap) end "error" and are released; a sequence admitted afterwards runs."""
    engine = FakeEngine()
    step = engine.decode_step

    def failing(batch, copy=True, fed=None):
        if len(engine.batch_sizes) == 3:
            engine.batch_sizes.append(0)
            raise RuntimeError("injected")
        return step(batch, copy, fed)

    engine.decode_step = failing

    async def body(batcher):
        params = SamplingParams(temperature=0, max_tokens=50)
        seqs = [batcher.admit(list(range(8 * i, 8 * i + 8)), 5, 10, params) for i in (0, 1)]
        ends = []
        for seq in seqs:
            with seq.tokens.reading():
                ends.append([item async for item in seq.tokens][-1].finish_reason)
            with anyio.fail_after(2):
                await seq.released.wait()
        assert not batcher.running
        return ends, await run_sequence(batcher, SamplingParams(temperature=0, max_tokens=4))

    ends, (_, _, chunks) = await with_batcher(engine, body)
    assert ends == ["error", "error"]
    assert joined(chunks)[0] == [10, 11, 12, 13] and chunks[-1].finish_reason == "length"


async def test_first_token_can_end_the_sequence_at_admission():
    engine = FakeEngine()

    async def body(batcher):
        return await run_sequence(batcher, SamplingParams(temperature=0, max_tokens=1))

    seq, stream, chunks = await with_batcher(engine, body)
    assert joined(chunks) == ([10], "w10 ")
    assert chunks[-1].finish_reason == "length" and engine.batch_sizes == []


async def test_seeded_tokens_are_the_same_alone_and_in_a_busy_batch():
    """The batch's one sampling call draws each sequence's token from its own (seed, step):
    the tokens equal sampling each step alone, whoever else is in the batch."""
    target = SamplingParams(temperature=1.5, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
    engine = FakeEngine(boost=3.0)
    expected, token, pos = [10], 10, 5  # the prefill sampled 10 at position 5
    for step in range(1, 30):
        token = sample(engine.logits_for(pos, token), target, step)
        expected.append(token)
        pos += 1

    async def alone(batcher):
        return await run_sequence(batcher, target)

    async def crowded(batcher):
        results = {}
        others = [
            SamplingParams(temperature=0, max_tokens=25),
            SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=12),
            SamplingParams(temperature=1.0, seed=2, max_tokens=40, ignore_eos=True),
        ]

        async def one(name, params, first):
            results[name] = await run_sequence(batcher, params, first_token=first)

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(others):
                tg.start_soon(one, i, p, 20 + i)
            await anyio.sleep(0.01)
            tg.start_soon(one, "target", target, 10)
        return results["target"]

    assert joined((await with_batcher(FakeEngine(boost=3.0), alone))[2])[0] == expected
    busy = FakeEngine(boost=3.0)
    assert joined((await with_batcher(busy, crowded))[2])[0] == expected
    assert max(busy.batch_sizes) > 1


async def test_a_cancelled_sequence_ends_its_stream_without_a_finish():
    async def body(batcher):
        seq = batcher.admit(list(range(8)), 5, 10, SamplingParams(temperature=0, max_tokens=500))
        stream = TokenStream(seq, FakeTokenizer(), batcher.cancel)
        await stream.next()
        batcher.cancel(seq)
        deadline = time.monotonic() + 2
        try:
            while time.monotonic() < deadline:
                assert (await stream.next()).finish_reason is None
        except anyio.EndOfStream:
            pass
        else:
            raise AssertionError("the stream never ended")
        await seq.released.wait()
        return batcher

    batcher = await with_batcher(FakeEngine(), body)
    assert not batcher.running and not batcher.waiting


CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.gpu_smoke,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
])


@pytest.mark.parametrize("device", ["cpu", CUDA])
async def test_the_batch_samples_what_a_colocated_run_samples(device):
    """A real engine: four sequences (greedy, top-p, top-k, plain temperature) decoded in
    one batch whose make-up changes as they finish give each the tokens a colocated run
    gives it alone, sampled step by step."""
    config = ModelConfig.tiny()
    weights = random_weights(config, seed=3).to(device, torch.float32)
    engine = Engine(config, weights, KvPool(config, 64, 16, device=device, dtype=torch.float32))
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=50, seed=12, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=13, max_tokens=16, ignore_eos=True),
    ]
    alone = [generate(engine, prompt, p) for prompt, p in zip(prompts, params, strict=True)]

    async def together(batcher):
        seqs = []
        for prompt, p in zip(prompts, params, strict=True):  # prefilled before any step
            pages = engine.pool.alloc(engine.pool.pages_for(len(prompt) + p.max_tokens))
            first = sample(engine.prefill(prompt, pages), p, 0)
            seqs.append(batcher.admit(pages, len(prompt), first, p))
        out = []
        for seq in seqs:
            with seq.tokens.reading():
                out.append([item.token async for item in seq.tokens])
            await seq.released.wait()
            engine.pool.free(seq.pages)
        return out

    assert await with_batcher(engine, together) == alone



async def test_the_batch_keeps_where_each_step_spent_its_time():
    """Every step adds its parts to the batch's running totals: compute holds the compute
    thread's step (here a 5 ms sleep), the others the event loop's share of the step."""
    params = SamplingParams(temperature=0, max_tokens=12)

    async def body(batcher):
        started = time.perf_counter()
        await run_sequence(batcher, params)
        return batcher, time.perf_counter() - started

    batcher, elapsed = await with_batcher(SlowEngine(0.005), body)
    parts = batcher.step_seconds
    assert list(parts) == ["prepare", "dispatch", "compute", "resume", "handoff"]
    assert batcher.steps == 11  # the first of the 12 tokens is the prefill's
    assert 11 * 0.005 <= parts["compute"] < elapsed
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= elapsed
