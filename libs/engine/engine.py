"""Step functions over a paged KV cache: chunked prefill and batched decode.

No threads, no queues: a scheduler calls ``prefill`` and ``decode_step`` and owns the pages.
A step packs its small inputs (tokens, positions, the pages of each sequence) into one
int tensor on the host, moves it to the device in one copy and derives every index there:
no index tensors built from Python lists per token or per layer. Attention writes the new
K/V into the pool in place and reads keys where the pool holds them (attention.py).

Decode is B sequences of one token. `decode_forward` runs over device tensors whose shapes
depend only on B and the page table's width, so on CUDA the engine replays it from CUDA
graphs captured per batch-size bucket (graphs.py), with a page table as wide as
``max_context`` needs; ``cuda_graphs=False`` launches the same padded forward eagerly, the
reference the graphs are tested against, with the same bits. On CPU it always runs
eagerly at the step's own shapes, the table as wide as its longest sequence needs.

Prefill packs its chunks into B=1 with T tokens and attends under a block-diagonal causal
mask (attention.PrefillAttention); every index of the pack is one int32 array built on
the host (prefill_pack.py). On CUDA, once `capture_prefill_graphs` ran, a pack padded to
its (tokens, keys, rows) bucket replays a graph (prefill_graphs.py): an eager prefill of
a small model is a few hundred launches whatever its length, so the host, not the GPU,
would set the time to first token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .attention import DecodeAttention, PrefillAttention
from .config import ModelConfig
from .graphs import DecodeGraphs
from .kvpool import KvPool
from .model import Weights, add_rms_norm, attention_block, rms_norm, rope_tables, swiglu_mlp
from .prefill_graphs import PrefillGraphs
from .prefill_pack import columns, pack_prefill

DEFAULT_MAX_BATCH = 256  # the largest decode graph bucket unless the engine is told less

# Columns of a packed decode step, one row a sequence, then the page table.
TOKEN, POSITION, LENGTH, PAGES = 0, 1, 2, 3


def feed_tokens(rows: torch.Tensor, fed: torch.Tensor | None) -> None:
    """In packed decode rows on the device, replace each token -(j + 1) by fed[j], in
    place (a few small kernels, no host sync). Padding rows (token 0) stay as they are."""
    if fed is None:
        return
    tokens = rows[:, TOKEN]
    index = (-1 - tokens).clamp_(0, fed.numel() - 1)
    tokens.copy_(torch.where(tokens < 0, fed.to(tokens.dtype)[index], tokens))


class ForwardCancelled(Exception):
    """A forward pass stopped early because its caller no longer wants it."""


@dataclass(slots=True)  # one a sequence a step: slots make it cheap to build
class DecodeSeq:
    pages: list[int]  # cover positions 0..pos inclusive
    pos: int  # position of `token` = number of tokens already in the cache
    token: int


@dataclass
class PrefillSeq:
    tokens: Sequence[int]  # this chunk's tokens, at positions start_pos..
    pages: Sequence[int]  # cover positions 0..start_pos + len(tokens) - 1
    start_pos: int = 0
    # The logits of every token of the chunk, not just its last: what prompt logprobs
    # (echo) need; asked per chunk so a pack without them computes one row a chunk.
    all_logits: bool = False


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        pool: KvPool,
        *,
        cuda_graphs: bool | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_context: int | None = None,
    ) -> None:
        """cuda_graphs: decode through CUDA graphs (default: on CUDA, yes). max_batch: the
        largest graph bucket (a larger decode batch runs as several replays).
        max_context: the longest sequence decode accepts (default the model's
        max_position); it sizes the graphs' page table."""
        if pool.device != weights.device or pool.dtype != weights.dtype:
            raise ValueError("pool and weights must share device and dtype")
        self.config = config
        self.weights = weights
        self.pool = pool
        self.device = weights.device
        self.cos, self.sin = rope_tables(config, self.device, weights.dtype)
        self.max_context = config.max_position if max_context is None else max_context
        if not 1 <= self.max_context <= config.max_position:
            raise ValueError(f"max_context must be in 1..{config.max_position}")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs an engine on a CUDA device")
        # On CUDA decode runs at static shapes, captured into graphs or launched eagerly
        # (``cuda_graphs=False``): the same kernels on the same shapes, the same bits.
        self.graphs: DecodeGraphs | None = None
        self._static: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # capture_prefill_graphs
        if self.device.type == "cuda":
            width = PAGES + pool.pages_for(self.max_context)
            self._static = DecodeGraphs(
                lambda inputs: self.decode_forward(inputs, self.max_context),
                self.device, width, max_batch, capture=cuda_graphs, feed=feed_tokens,
            )
            if cuda_graphs:
                self.graphs = self._static

    def prefill(
        self, tokens: Sequence[int], pages: Sequence[int], start_pos: int = 0
    ) -> torch.Tensor:
        """KV of ``tokens`` at positions start_pos.. into ``pages``; logits [vocab] of the last.

        ``pages`` cover the sequence from position 0, so repeated calls with consecutive chunks
        attend to the KV that earlier chunks wrote and equal one call over the whole prompt.
        """
        return self.prefill_batch([PrefillSeq(tokens, pages, start_pos)])[0]

    @torch.inference_mode()
    def prefill_batch(
        self, seqs: Sequence[PrefillSeq], should_stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Prefill several sequences (or chunks) in one forward; logits [N, vocab] of each last.

        A chunk with ``all_logits`` has a row for each of its tokens instead of one, in
        order: the rows are then the chunks' rows one after the other (``logit_rows``).
        The chunks are packed into one row of tokens with a block-diagonal causal mask, so the
        weights stream through the cores once for the whole batch. Attention over the pack is
        quadratic in its total length: keep a pack to a few thousand tokens.
        """
        if not seqs:
            raise ValueError("prefill_batch needs at least one sequence")
        for s in seqs:
            if len(s.tokens) == 0:
                raise ValueError("prefill needs at least one token")
            self._check_pages(s.pages, s.start_pos + len(s.tokens), self.config.max_position)
        graphs = self.prefill_graphs
        bucket = None if graphs is None else graphs.bucket(
            sum(len(s.tokens) for s in seqs), sum(s.start_pos + len(s.tokens) for s in seqs),
            sum(self.logit_rows(seqs)))
        packed = pack_prefill([(s.tokens, s.pages, s.start_pos, s.all_logits) for s in seqs],
                              self.pool.page_size, bucket)
        self._check_ids(packed.token_ids, packed.key_pages)
        if bucket is not None:
            if should_stop is not None and should_stop():
                raise ForwardCancelled("stopped before the forward")
            return graphs.run(packed)[: packed.real_rows].clone()
        # One host-to-device copy: the pack's every index (prefill_pack.py).
        data = torch.from_numpy(packed.data).to(self.device)
        logits = self.prefill_packed(data, packed.tokens, packed.keys, packed.rows,
                                     should_stop)
        return logits[: packed.real_rows]

    @staticmethod
    def logit_rows(seqs: Sequence[PrefillSeq]) -> list[int]:
        """How many rows of ``prefill_batch``'s logits each chunk has, in order."""
        return [len(s.tokens) if s.all_logits else 1 for s in seqs]

    def prefill_packed(self, data: torch.Tensor, t: int, k: int, r: int,
                       should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Logits [r, vocab] (fp32) of a pack in prefill_pack.py's layout, on the device
        (T = t tokens, K = k keys, R = r output rows): the forward a prefill graph
        replays, at shapes that depend only on (t, k, r)."""
        queries, keys, out_index = columns(data, t, k, r)
        tokens, positions, owners, write_pages, write_slots = queries
        key_owners, key_positions, key_pages, key_slots = keys
        # A query sees the keys of its own chunk's sequence at positions <= its own.
        mask = ((owners[:, None] == key_owners[None, :])
                & (key_positions[None, :] <= positions[:, None]))
        attn = PrefillAttention(self.pool.tensor, write_pages, write_slots, key_pages,
                                key_slots, mask)
        return self._prefill_forward(tokens, positions, attn, out_index, should_stop)

    def capture_prefill_graphs(self, max_tokens: int) -> list[tuple[int, int, int]]:
        """Capture prefill graphs for packs of up to ``max_tokens`` tokens (CUDA with
        graphs only; a no-op otherwise). Call it before any page holds KV: the warm-up
        and capture passes write into page 0. Returns the buckets captured; raises
        GraphOutOfMemory naming the flags to change."""
        if self.graphs is None:
            return []
        self.prefill_graphs = PrefillGraphs(self.prefill_packed, self.device, max_tokens,
                                            max(max_tokens, self.max_context))
        with torch.inference_mode():
            return self.prefill_graphs.capture_all()

    def _check_ids(self, tokens: np.ndarray, pages: np.ndarray, lowest: int = 0) -> None:
        """Out-of-range ids would be out-of-bounds reads and writes in the CUDA kernels.
        (A decode token down to ``lowest`` names a fed id: see ``decode_step``.)"""
        if tokens.min() < lowest or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token id outside the vocabulary of {self.config.vocab_size}")
        if pages.min() < 0 or pages.max() >= self.pool.num_pages:
            raise ValueError(f"page id outside the pool's {self.pool.num_pages} pages")

    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[DecodeSeq], copy: bool = True,
                    fed: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B sequences in one forward; logits [B, vocab] (fp32) on the
        engine's device.

        Through CUDA graphs the logits are the graph's output buffer, valid until the next
        decode step: ``copy=True`` (the default) returns a copy the caller keeps,
        ``copy=False`` the buffer itself (one device copy less a step, for a caller that
        reads it before its next decode step).

        ``fed``: token ids on the device (the previous step's sampled ones), for a step
        launched before those reached the host: a sequence whose ``token`` is -(j + 1)
        feeds ``fed[j]``. Nothing waits for ``fed``; the device reads it in stream order."""
        if not seqs:
            raise ValueError("decode_step needs at least one sequence")
        for s in seqs:
            self._check_pages(s.pages, s.pos + 1, self.max_context)
        packed = self._pack_decode(seqs, 0 if fed is None else fed.numel())
        if self._static is not None:
            logits = self._static.run(packed, fed)
            return logits.clone() if copy and self.graphs is not None else logits
        inputs = packed.to(self.device)
        feed_tokens(inputs, fed)
        return self.decode_forward(inputs, max(s.pos for s in seqs) + 1)

    def capture_decode_graphs(self, max_batch: int | None = None) -> list[int]:
        """Capture the decode graphs now, for every bucket up to the one holding
        ``max_batch`` sequences (default: all), rather than each at its first use: a
        member calls this at start-up. Returns the batch sizes captured (none without
        graphs). Raises GraphOutOfMemory naming the flags to change."""
        if self.graphs is None:
            return []
        with torch.inference_mode():
            return self.graphs.capture_all(max_batch)

    def _pack_decode(self, seqs: Sequence[DecodeSeq], fed: int = 0) -> torch.Tensor:
        """[B, PAGES + W] int32 on the host: token, position, length (position + 1) and the
        pages covering positions 0..position, zero-padded to the widest row. (Through numpy:
        a few times faster than torch.tensor on nested lists, ~0.15 ms at B=128.) A token
        may be -(j + 1) for j < ``fed``: one of the fed ids (``decode_step``)."""
        ps = self.pool.page_size
        n_pages = [s.pos // ps + 1 for s in seqs]
        width = max(n_pages)
        rows = []
        for s, n in zip(seqs, n_pages, strict=True):
            row = [s.token, s.pos, s.pos + 1]
            row.extend(s.pages[:n])
            row.extend([0] * (width - n))
            rows.append(row)
        cols = PAGES + width
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, len(rows) * cols)
        packed = flat.reshape(len(rows), cols)
        self._check_ids(packed[:, TOKEN], packed[:, PAGES:], lowest=-fed)
        return torch.from_numpy(packed)

    def _check_pages(self, pages: Sequence[int], num_tokens: int, limit: int) -> None:
        need = self.pool.pages_for(num_tokens)
        if len(pages) < need:
            raise ValueError(f"{num_tokens} tokens need {need} pages, got {len(pages)}")
        if num_tokens > limit:
            what = "max_position" if limit == self.config.max_position else "max_context"
            raise ValueError(f"position {num_tokens - 1} beyond {what} ({limit})")

    def decode_forward(self, inputs: torch.Tensor, max_len: int) -> torch.Tensor:
        """Logits [B, vocab] (fp32) of a packed decode step (`_pack_decode`'s layout, on
        the engine's device; a row of zeros is padding: it writes no KV and its logits
        are garbage). max_len bounds the sequences' lengths: it sizes the split of
        attention over long contexts, so a graph passes its capacity."""
        c, w = self.config, self.weights
        b, hkv = inputs.shape[0], c.n_kv_heads
        positions = inputs[:, POSITION]
        splits = 1
        if self.device.type == "cuda":
            from libs.kernels.paged_attention import num_splits

            splits = num_splits(b, hkv, max_len, self.device)
        attend = DecodeAttention(
            self.pool.tensor, inputs[:, PAGES:], inputs[:, LENGTH], splits
        )
        cos = self.cos[positions][:, None, :]  # [B, 1, D]
        sin = self.sin[positions][:, None, :]
        x = w.embed[inputs[:, TOKEN]]  # [B, dim]
        x = self._layers(x, cos, sin, attend)
        return F.linear(rms_norm(x, w.norm, c.norm_eps), w.lm_head).float()

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[..., torch.Tensor],
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Every layer over the residual stream x (updated in place, and returned), for
        decode and prefill alike. Each residual add is fused with the RMSNorm after it
        (model.add_rms_norm): attention's with the layer's ffn_norm, the MLP's with the
        next layer's attn_norm; the last MLP's is a plain add, the final norm the
        caller's (prefill norms only the rows whose logits it returns)."""
        c, layers = self.config, self.weights.layers
        h = rms_norm(x, layers[0].attn_norm, c.norm_eps)
        for layer, lw in enumerate(layers):
            if should_stop is not None and should_stop():
                # Every request of this pass is gone: stop at a layer boundary rather than
                # finish a forward nobody will read (the KV written so far is garbage).
                raise ForwardCancelled(f"stopped before layer {layer}")
            attn = attention_block(h, lw, c, cos, sin, attend, layer)
            h = add_rms_norm(x, attn, lw.ffn_norm, c.norm_eps)
            if should_stop is not None and should_stop():  # and halfway: a long pack's
                raise ForwardCancelled(f"stopped in layer {layer}")  # layer is ~40 ms on CPU
            mlp = swiglu_mlp(h, lw)
            if layer + 1 < len(layers):
                h = add_rms_norm(x, mlp, layers[layer + 1].attn_norm, c.norm_eps)
            else:
                x.add_(mlp)
        return x

    def _prefill_forward(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attend: PrefillAttention,
        out_index: torch.Tensor,  # token indices whose logits to return
        should_stop: Callable[[], bool] | None = None,  # checked between layers
    ) -> torch.Tensor:
        c, w = self.config, self.weights
        cos = self.cos[positions][None, :, None, :]  # [1, T, 1, D]
        sin = self.sin[positions][None, :, None, :]
        x = w.embed[tokens][None]  # [1, T, dim]
        x = self._layers(x, cos, sin, attend, should_stop)
        x = rms_norm(x[0, out_index], w.norm, c.norm_eps)  # only these logits are used
        return F.linear(x, w.lm_head).float()
