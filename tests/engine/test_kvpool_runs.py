"""KvPool hands out as few runs of consecutive page ids as it can (one NIXL descriptor per
run that is consecutive on both ends), and its free runs stay exact under any churn."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libs.engine.kvpool import KvPool

from .conftest import small_config


def runs_of(pages: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive ids in ascending ``pages``."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and p == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def test_a_request_gets_the_smallest_run_that_holds_it():
    pool = KvPool(small_config(), num_pages=32, page_size=4)
    a, b, c, d = pool.alloc(8), pool.alloc(3), pool.alloc(8), pool.alloc(2)
    assert (b, d) == ([8, 9, 10], [19, 20])  # an empty pool's pages come in id order
    pool.free(a)
    pool.free(c)  # free runs: [0, 8), [11, 19) and [21, 32)
    assert pool.alloc(6) == list(range(0, 6))  # the smallest that holds 6, lowest ids first
    assert pool.alloc(8) == list(range(11, 19))  # an exact fit
    assert pool.alloc(9) == list(range(21, 30))


def test_without_a_run_that_fits_the_largest_runs_go_first():
    pool = KvPool(small_config(), num_pages=16, page_size=4)
    pool.alloc(16)
    pool.free([0, 1, 4, 5, 6, 9, 12, 13, 14, 15])  # free runs of 2, 3, 1 and 4 pages
    pages = pool.alloc(8)  # 4 + 3 + 1 of the 2: three runs, where lowest ids give four
    assert pages == [0, 4, 5, 6, 12, 13, 14, 15]
    assert pool.free_count == 2 and pool.alloc(2) == [1, 9]


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24), st.randoms()), max_size=60))
def test_free_runs_stay_exact_under_churn(ops) -> None:
    pool = KvPool(small_config(), num_pages=64, page_size=4)
    held: list[list[int]] = []
    for allocate, n, rnd in ops:
        if allocate and n <= pool.free_count:
            free = [p for p in range(64) if pool._is_free[p]]
            fits = [length for _, length in runs_of(free) if length >= n]
            pages = pool.alloc(n)
            assert len(pages) == n == len(set(pages)) and pages == sorted(pages)
            assert all(p in free for p in pages)
            if fits:  # one run, out of the smallest free run that holds n pages
                assert len(runs_of(pages)) == 1
                assert any(start <= pages[0] and pages[-1] < start + length
                           for start, length in runs_of(free) if length == min(fits))
            held.append(pages)
        elif held:
            pool.free(held.pop(rnd.randrange(len(held))))
        free = [p for p in range(64) if pool._is_free[p]]
        assert pool.free_count == len(free) and pool.used == 64 - len(free)
        assert sorted(pool._runs.items()) == runs_of(free)  # maximal runs, nothing stale
