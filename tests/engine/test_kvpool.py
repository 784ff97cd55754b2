"""KvPool: layout, allocation order, exhaustion, double free, page copies."""

from __future__ import annotations

import pytest
import torch

from libs.engine.kvpool import KvPool, PoolExhausted

from .conftest import small_config


def test_layout_and_page_bytes():
    cfg = small_config()
    pool = KvPool(cfg, num_pages=8, page_size=4)
    assert pool.tensor.shape == (8, cfg.n_layers, 2, cfg.n_kv_heads, 4, cfg.head_dim)
    assert pool.tensor.is_contiguous()
    assert pool.page_bytes == cfg.n_layers * 2 * cfg.n_kv_heads * 4 * cfg.head_dim * 4
    assert pool.page_ptr(3) - pool.page_ptr(2) == pool.page_bytes
    assert pool.page_view(5).data_ptr() == pool.page_ptr(5)
    assert pool.pages_for(0) == 0 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


def test_alloc_low_first_and_free():
    pool = KvPool(small_config(), num_pages=8, page_size=4)
    a = pool.alloc(3)
    assert a == [0, 1, 2]
    b = pool.alloc(2)
    assert b == [3, 4]
    assert pool.used == 5 and pool.free_count == 3
    pool.free(a)
    assert pool.alloc(4) == [0, 1, 2, 5]
    assert pool.free_count == 2


def test_exhaustion_is_typed_and_allocates_nothing():
    pool = KvPool(small_config(), num_pages=4, page_size=4)
    pool.alloc(3)
    with pytest.raises(PoolExhausted) as e:
        pool.alloc(2)
    assert e.value.requested == 2 and e.value.free == 1
    assert pool.free_count == 1


def test_double_free_and_unknown_page():
    pool = KvPool(small_config(), num_pages=4, page_size=4)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(ValueError):
        pool.free([pages[0]])
    with pytest.raises(ValueError):
        pool.free([99])
    p = pool.alloc(1)
    with pytest.raises(ValueError):
        pool.free([p[0], p[0]])  # duplicate within one call
    assert pool.used == 1  # the failed call freed nothing


def test_copy_pages():
    cfg = small_config()
    src, dst = KvPool(cfg, 4, 4), KvPool(cfg, 4, 4)
    src.tensor.normal_()
    dst.copy_pages(src, [1, 3], [2, 0])
    assert torch.equal(dst.tensor[2], src.tensor[1]) and torch.equal(dst.tensor[0], src.tensor[3])
    assert not dst.tensor[1].any()
