"""A prefill pack as one int32 array (libs/engine/prefill_pack.py), on CPU: its columns,
the padding a prefill graph runs with (it changes no logit and no page outside the
pack's own slots), the buckets, and bad ids refused before any kernel reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.engine.engine import PrefillSeq
from libs.engine.prefill_graphs import prefill_buckets
from libs.engine.prefill_pack import pack_prefill

from .conftest import make_engine


def test_columns_of_a_fresh_and_a_continuing_chunk():
    packed = pack_prefill([([5, 6, 7], [3], 0, False), ([8, 9], [4, 5], 15, False)], 16)
    t, k = packed.tokens, packed.keys
    assert (t, k, packed.rows, packed.real_rows) == (5, 20, 2, 2)
    queries = packed.data[: 5 * t].reshape(5, t)
    assert queries.tolist() == [
        [5, 6, 7, 8, 9],  # tokens
        [0, 1, 2, 15, 16],  # positions
        [0, 0, 0, 1, 1],  # owners
        [3, 3, 3, 4, 5],  # write pages
        [0, 1, 2, 15, 0],  # write slots
    ]
    owners, positions, pages, slots = packed.data[5 * t : 5 * t + 4 * k].reshape(4, k)
    assert owners.tolist() == [0] * 3 + [1] * 17
    assert positions.tolist() == [0, 1, 2, *range(17)]
    assert pages.tolist() == [3] * 3 + [4] * 16 + [5]
    assert slots.tolist() == [0, 1, 2, *range(16), 0]
    assert packed.data[5 * t + 4 * k :].tolist() == [2, 4]  # each chunk's last token


def test_padding_repeats_the_last_token_and_adds_keys_nobody_sees():
    packed = pack_prefill([([5, 6], [3], 0, False), ([8], [4], 0, True)], 16, (8, 12, 4))
    t, k = 8, 12
    queries = packed.data[: 5 * t].reshape(5, t)
    assert (queries[:, 3:] == queries[:, 2:3]).all()  # token 8 again, same slot
    owners = packed.data[5 * t : 5 * t + 4 * k].reshape(4, k)[0]
    assert owners.tolist() == [0, 0, 1] + [-1] * 9
    assert packed.data[5 * t + 4 * k :].tolist() == [1, 2, 2, 2]
    assert packed.real_rows == 2
    with pytest.raises(ValueError, match="exceeds its bucket"):
        pack_prefill([([5, 6], [3], 0, False)], 16, (1, 16, 1))


def _chunks(eng):
    """A continuing chunk (its sequence's first 13 tokens already prefilled) packed with
    a fresh prompt, as the prefill scheduler packs them."""
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randint(3, 512, (n,), generator=gen).tolist() for n in (30, 9))
    pa, pb = eng.pool.alloc(eng.pool.pages_for(30)), eng.pool.alloc(eng.pool.pages_for(9))
    eng.prefill(a[:13], pa)
    return [(a[13:], pa, 13, False), (b, pb, 0, False)], pa + pb


def test_a_padded_pack_computes_the_same_logits_and_kv():
    """What a prefill graph replays: the pack padded to a larger bucket. The real rows'
    logits and every KV slot equal the unpadded pack's, and pages outside the pack are
    untouched."""
    results = []
    for pad in (None, (32, 64, 8)):
        eng = make_engine(page_size=8)
        chunks, used = _chunks(eng)
        packed = pack_prefill(chunks, eng.pool.page_size, pad)
        with torch.inference_mode():
            logits = eng.prefill_packed(torch.from_numpy(packed.data), packed.tokens,
                                        packed.keys, packed.rows)
        results.append((logits[: packed.real_rows], eng.pool.tensor.clone(), used))
    (plain, plain_kv, used), (padded, padded_kv, _) = results
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded_kv[used], plain_kv[used], atol=1e-5, rtol=1e-5)
    others = [p for p in range(padded_kv.shape[0]) if p not in used]
    assert not padded_kv[others].any()  # the padding wrote nowhere else


def test_prefill_batch_refuses_ids_outside_the_vocabulary_or_the_pool():
    eng = make_engine(num_pages=4)
    pages = eng.pool.alloc(1)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.prefill_batch([PrefillSeq([5, 512], pages, 0)])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.prefill_batch([PrefillSeq([-1, 5], pages, 0)])
    with pytest.raises(ValueError, match="page id outside"):
        eng.prefill_batch([PrefillSeq([5, 6], [4], 0)])
    with pytest.raises(ValueError, match="outside int32"):  # not wrapped into range
        eng.prefill_batch([PrefillSeq([5, 2**32 + 5], pages, 0)])
    with pytest.raises(ValueError, match="page id outside"):  # a page it would only read
        eng.prefill_batch([PrefillSeq([5, 6], [9, *pages], 16)])
    assert not eng.pool.tensor.any()  # refused before any write


def test_buckets_double_the_tokens_and_quadruple_the_keys():
    buckets = prefill_buckets(512, 4096)
    assert [b for b in buckets if b[0] == 16] == [
        (16, 16, 16), (16, 64, 16), (16, 256, 16), (16, 1024, 16), (16, 4096, 16)]
    assert [b for b in buckets if b[0] == 512] == [(512, 512, 32), (512, 2048, 32),
                                                  (512, 4096, 32)]
    assert sorted({b[0] for b in buckets}) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(3000, 3000)[-1] == (3000, 3000, 32)  # the budget itself
    assert np.all([b[1] <= 4096 for b in buckets])
    with pytest.raises(ValueError):
        prefill_buckets(512, 256)
