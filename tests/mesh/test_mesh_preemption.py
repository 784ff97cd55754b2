"""KV reserved as it is used, on a real mesh whose decode pool is deliberately small:
concurrent long generations outgrow it, the decode preempts the newest, the router re-runs
it, and every request still gets the tokens it gets alone (greedy or seeded); a client
that leaves while its request is preempted leaves nothing behind.

The tiny model repeats a token for most prompts, so token equality here checks the
plumbing (every token arrives once, in order, counted); that a continuation samples the
very tokens of an unpreempted run is checked on a context-sensitive model in
tests/services/test_decode_growth.py and on SmolLM2 by `python -m bench.preemption`.

The decode here overlaps its steps (`--overlap-steps on`; the other mesh tests run the
CPU's default, serial): preemption then has to wait until no step is on the device, and a
sequence that ends under a launched step is released after it."""

from __future__ import annotations

import time

import anyio
import pytest

from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet

WORDS = "river engine harbour lantern meadow copper signal orchard thunder violet".split()
POOL = 28  # decode pages of 16 tokens: two long requests fit, a third does not
LONG = 180  # 20-word prompts + 180 tokens = 13 pages at their longest


def words(n: int, shift: int) -> str:
    """n words, one tiny-model token each; `shift` makes the prompts differ."""
    return " ".join(WORDS[(i * 7 + shift) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def small_decode(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("preempt"), model="tiny",
                      up_args=["--decode-kv-pages", str(POOL),
                               "--decode-args", "--overlap-steps on"])
    yield mesh
    mesh.stop()


async def run(mesh, prompt: str, *, max_tokens: int = LONG, **sampling) -> tuple[list[int], Done]:
    ids: list[int] = []
    async with GenerateClient(mesh.router, timeout=120) as client:
        async for item in client.generate(prompt=prompt, max_tokens=max_tokens,
                                          ignore_eos=True, **sampling):
            if isinstance(item, Piece):
                ids += item.token_ids
            else:
                return ids, item
    raise AssertionError("no Done")


def decode_stats(mesh) -> dict:
    return next(m for m in mesh.status()["members"] if m["role"] == "decode")


async def preemptions(mesh) -> int:
    return (await anyio.to_thread.run_sync(decode_stats, mesh))["preemptions_total"]


async def alone(mesh, prompts, **sampling) -> list[list[int]]:
    out = []
    for prompt in prompts:  # one at a time: each fits the pool, nothing is preempted
        out.append((await run(mesh, prompt, **sampling))[0])
    return out


async def together(mesh, prompts, stagger: float = 0.3, **sampling) -> list[tuple]:
    """The prompts started `stagger` seconds apart, so admission order (and so which one
    is newest) follows the list."""
    results: list = [None] * len(prompts)

    async def one(i):
        results[i] = await run(mesh, prompts[i], **sampling)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
            await anyio.sleep(stagger)
    return results


async def test_concurrent_greedy_generations_preempted_get_the_tokens_they_get_alone(
    small_decode,
):
    prompts = [words(20, shift) for shift in range(3)]  # 39 pages of demand, 28 in the pool
    expected = await alone(small_decode, prompts)
    before = await preemptions(small_decode)
    results = await together(small_decode, prompts, stagger=0.1)
    assert await preemptions(small_decode) > before
    for (ids, done), want in zip(results, expected, strict=True):
        assert ids == want
        assert (done.finish_reason, done.completion_tokens) == ("length", LONG)
    await anyio.to_thread.run_sync(wait_quiet, small_decode, 5.0)


async def test_a_seeded_request_preempted_mid_stream_samples_what_it_samples_alone(
    small_decode,
):
    prompts = [words(20, shift) for shift in (5, 6, 7)]  # the third, newest, is preempted
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    [expected] = await alone(small_decode, prompts[2:], **seeded)
    before = await preemptions(small_decode)
    results = await together(small_decode, prompts, **seeded)
    assert await preemptions(small_decode) > before
    ids, done = results[2]
    assert ids == expected
    assert done.completion_tokens == LONG
    await anyio.to_thread.run_sync(wait_quiet, small_decode, 5.0)


async def test_a_client_that_leaves_while_its_request_is_preempted_leaves_nothing_behind(
    small_decode,
):
    """The third request is preempted; while its re-run waits for room (the other two
    hold the pool) its client leaves. The others finish, and the mesh is quiescent with
    no room, page or in-flight request left of it."""
    prompts = [words(20, shift) for shift in (8, 9, 3)]
    before = await preemptions(small_decode)
    left_at: list[float] = []

    async def leaver():
        with anyio.CancelScope() as scope:
            async def watch():
                while await preemptions(small_decode) == before:
                    await anyio.sleep(0.02)
                left_at.append(time.monotonic())
                scope.cancel()  # the client leaves, its request between preemption and re-run

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await run(small_decode, prompts[2])
                raise AssertionError("the newest request was never preempted")

    async with anyio.create_task_group() as tg:
        results: list = []

        async def keeper(prompt):
            results.append(await run(small_decode, prompt))

        tg.start_soon(keeper, prompts[0])
        await anyio.sleep(0.1)  # close together: the three outgrow the pool before any ends
        tg.start_soon(keeper, prompts[1])
        await anyio.sleep(0.1)
        tg.start_soon(leaver)
    assert left_at
    assert [done.completion_tokens for _, done in results] == [LONG, LONG]
    status = await anyio.to_thread.run_sync(wait_quiet, small_decode, 10.0)
    for member in status["members"]:
        if member["role"] in ("prefill", "decode"):
            assert not member["pinned"], member
            assert not member["rooms"].get("bootstrapping"), member
    router = next(m for m in status["members"] if m["role"] == "router")
    assert not router["inflight"], router
