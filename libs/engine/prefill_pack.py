"""A prefill pack's inputs as one int32 array, built on the host and copied once.

A pack is N chunks laid end to end in one row of T tokens; its attention sees, for each
chunk, the K/V of its whole sequence so far (earlier chunks and this one), K keys in all.
Everything the forward needs is a column of this array, in order:

    tokens, positions, owners, write pages, write slots      5 x T  (one per new token)
    key owners, key positions, key pages, key slots          4 x K  (one per key)
    output rows                                              R      (the logits wanted)

An owner is the chunk's index in the pack; a query attends to the keys of its own owner
at positions up to its own (the mask is built from these columns on the device).

Padded to buckets (T_b, K_b, R_b), the shapes are fixed, so a CUDA graph can replay the
forward (prefill_graphs.py): a padding query repeats the pack's last token (same token,
position, owner and slot: it computes and writes the very same K/V bits), a padding key
has owner -1 (nobody attends to it), and a padding output row repeats the last one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

QUERY_COLUMNS, KEY_COLUMNS = 5, 4


def packed_size(t: int, k: int, r: int) -> int:
    """Elements of a pack of t tokens, k keys and r output rows."""
    return QUERY_COLUMNS * t + KEY_COLUMNS * k + r


def columns(data, t: int, k: int, r: int):
    """(queries [5, t], keys [4, k], output rows [r]): views of a pack's array, numpy on
    the host or torch on the device."""
    keys_at = QUERY_COLUMNS * t
    rows_at = keys_at + KEY_COLUMNS * k
    return (data[:keys_at].reshape(QUERY_COLUMNS, t), data[keys_at:rows_at].reshape(KEY_COLUMNS, k),
            data[rows_at : rows_at + r])


@dataclass(frozen=True)
class PackedPrefill:
    data: np.ndarray  # int32 [packed_size(tokens, keys, rows)]
    tokens: int  # T (padded)
    keys: int  # K (padded)
    rows: int  # R (padded)
    real_rows: int  # the first real_rows output rows are the pack's own

    @property
    def token_ids(self) -> np.ndarray:
        return columns(self.data, self.tokens, self.keys, self.rows)[0][0]

    @property
    def key_pages(self) -> np.ndarray:
        """Every page the pack reads or writes (each new token is also a key)."""
        return columns(self.data, self.tokens, self.keys, self.rows)[1][2]


def pack_prefill(chunks: Sequence[tuple[Sequence[int], Sequence[int], int, bool]],
                 page_size: int, pad_to: tuple[int, int, int] | None = None) -> PackedPrefill:
    """chunks: (tokens, pages from position 0, start position, every row's logits?).
    pad_to: (T_b, K_b, R_b), each no smaller than the pack's own."""
    lengths = np.array([len(c[0]) for c in chunks], dtype=np.int64)
    starts = np.array([c[2] for c in chunks], dtype=np.int64)
    ends = starts + lengths
    n = len(chunks)
    owner = np.arange(n)
    # Each chunk's pages, one flat list; page j of chunk i is pages[page_first[i] + j].
    spans = [np.asarray(c[1][: -(-int(e) // page_size)], dtype=np.int64)
             for c, e in zip(chunks, ends, strict=True)]
    pages = np.concatenate(spans)
    page_first = np.cumsum([0] + [len(s) for s in spans[:-1]])

    t = int(lengths.sum())
    q_owner = np.repeat(owner, lengths)
    q_pos = np.arange(t) - np.repeat(np.cumsum(lengths) - lengths, lengths) + starts[q_owner]
    k = int(ends.sum())
    k_owner = np.repeat(owner, ends)
    k_pos = np.arange(k) - np.repeat(np.cumsum(ends) - ends, ends)
    last = np.cumsum(lengths) - 1
    out = np.concatenate([np.arange(last[i] - lengths[i] + 1, last[i] + 1) if c[3]
                          else last[i : i + 1] for i, c in enumerate(chunks)])

    queries = np.stack([
        np.concatenate([np.asarray(c[0], dtype=np.int64) for c in chunks]),
        q_pos, q_owner,
        pages[page_first[q_owner] + q_pos // page_size], q_pos % page_size,
    ])
    keys = np.stack([k_owner, k_pos, pages[page_first[k_owner] + k_pos // page_size],
                     k_pos % page_size])
    real = len(out)
    t_b, k_b, r_b = pad_to or (t, k, real)
    if t_b < t or k_b < k or r_b < real:
        raise ValueError(f"pack of ({t}, {k}, {real}) exceeds its bucket "
                         f"({t_b}, {k_b}, {r_b})")
    queries = np.concatenate([queries, np.repeat(queries[:, -1:], t_b - t, 1)], 1)
    pad_key = np.array([[-1], [0], keys[2, :1], keys[3, :1]])
    keys = np.concatenate([keys, np.repeat(pad_key, k_b - k, 1)], 1)
    out = np.concatenate([out, np.repeat(out[-1:], r_b - real)])
    data = np.concatenate([queries.reshape(-1), keys.reshape(-1), out])
    if data.min() < np.iinfo(np.int32).min or data.max() > np.iinfo(np.int32).max:
        raise ValueError("a token or page id outside int32")  # the cast would wrap it
    data = data.astype(np.int32)
    return PackedPrefill(data, t_b, k_b, r_b, real)
