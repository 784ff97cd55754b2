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
mask (attention.PrefillAttention).
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

DEFAULT_MAX_BATCH = 256  # the largest decode graph bucket unless the engine is told less

# Columns of a packed decode step, one row a sequence, then the page table.
TOKEN, POSITION, LENGTH, PAGES = 0, 1, 2, 3


class ForwardCancelled(Exception):
    """A forward pass stopped early because its caller no longer wants it."""


@dataclass
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
        if self.device.type == "cuda":
            width = PAGES + pool.pages_for(self.max_context)
            self._static = DecodeGraphs(
                lambda inputs: self.decode_forward(inputs, self.max_context),
                self.device, width, max_batch, capture=cuda_graphs,
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
        tokens, meta, width, n_keys = [], [], 0, 0
        for s in seqs:
            if len(s.tokens) == 0:
                raise ValueError("prefill needs at least one token")
            end = s.start_pos + len(s.tokens)
            self._check_pages(s.pages, end, self.config.max_position)
            tokens.extend(s.tokens)
            meta.append((len(s.tokens), s.start_pos))
            width = max(width, self.pool.pages_for(end))
            n_keys += end
        table = [list(s.pages[:width]) + [0] * (width - len(s.pages[:width])) for s in seqs]
        # One host-to-device copy: tokens, then (length, start) of each chunk, then pages.
        flat = [*tokens, *(v for m in meta for v in m), *(p for row in table for p in row)]
        packed = torch.tensor(flat, dtype=torch.int64).to(self.device)
        n, t = len(seqs), len(tokens)
        meta_t = packed[t : t + 2 * n].view(n, 2)
        attn, positions, last = self._prefill_indices(
            meta_t[:, 0], meta_t[:, 1], packed[t + 2 * n :].view(n, width), t, n_keys
        )
        out_index = last
        if any(s.all_logits for s in seqs):  # rare (echo): indices built on the host
            rows, first = [], 0
            for s in seqs:
                end = first + len(s.tokens)
                rows.extend(range(first, end) if s.all_logits else [end - 1])
                first = end
            out_index = torch.tensor(rows, device=self.device)
        return self._prefill_forward(packed[:t], positions, attn, out_index, should_stop)

    @staticmethod
    def logit_rows(seqs: Sequence[PrefillSeq]) -> list[int]:
        """How many rows of ``prefill_batch``'s logits each chunk has, in order."""
        return [len(s.tokens) if s.all_logits else 1 for s in seqs]

    def _prefill_indices(
        self, lengths: torch.Tensor, starts: torch.Tensor, table: torch.Tensor,
        n_tokens: int, n_keys: int,
    ) -> tuple[PrefillAttention, torch.Tensor, torch.Tensor]:
        """The pack's attention, each token's position and each chunk's last token index,
        from the chunks' lengths and starts [N] and page table [N, W], on the device."""
        ps, dev = self.pool.page_size, self.device
        seq = torch.arange(len(lengths), device=dev)
        ends = starts + lengths
        q_owner = torch.repeat_interleave(seq, lengths, output_size=n_tokens)
        q_first = torch.cumsum(lengths, 0) - lengths  # pack index of each chunk's first token
        q_pos = starts[q_owner] + torch.arange(n_tokens, device=dev) - q_first[q_owner]
        k_owner = torch.repeat_interleave(seq, ends, output_size=n_keys)
        k_first = torch.cumsum(ends, 0) - ends
        k_pos = torch.arange(n_keys, device=dev) - k_first[k_owner]
        # A query sees the keys of its own sequence at positions <= its own.
        mask = (q_owner[:, None] == k_owner[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        attn = PrefillAttention(
            self.pool.tensor,
            write_pages=table[q_owner, q_pos // ps], write_slots=q_pos % ps,
            key_pages=table[k_owner, k_pos // ps], key_slots=k_pos % ps, mask=mask,
        )
        return attn, q_pos, torch.cumsum(lengths, 0) - 1

    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[DecodeSeq], copy: bool = True) -> torch.Tensor:
        """One token for each of B sequences in one forward; logits [B, vocab] (fp32) on the
        engine's device.

        Through CUDA graphs the logits are the graph's output buffer, valid until the next
        decode step: ``copy=True`` (the default) returns a copy the caller keeps,
        ``copy=False`` the buffer itself (one device copy less a step, for a caller that
        reads it before its next decode step)."""
        if not seqs:
            raise ValueError("decode_step needs at least one sequence")
        for s in seqs:
            self._check_pages(s.pages, s.pos + 1, self.max_context)
        packed = self._pack_decode(seqs)
        if self._static is not None:
            logits = self._static.run(packed)
            return logits.clone() if copy and self.graphs is not None else logits
        return self.decode_forward(packed.to(self.device), max(s.pos for s in seqs) + 1)

    def capture_decode_graphs(self, max_batch: int | None = None) -> list[int]:
        """Capture the decode graphs now, for every bucket up to the one holding
        ``max_batch`` sequences (default: all), rather than each at its first use: a
        member calls this at start-up. Returns the batch sizes captured (none without
        graphs). Raises GraphOutOfMemory naming the flags to change."""
        if self.graphs is None:
            return []
        with torch.inference_mode():
            return self.graphs.capture_all(max_batch)

    def _pack_decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """[B, PAGES + W] int32 on the host: token, position, length (position + 1) and the
        pages covering positions 0..position, zero-padded to the widest row. (Through numpy:
        a few times faster than torch.tensor on nested lists, ~0.15 ms at B=128.)"""
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
        # Out-of-range ids would be out-of-bounds reads and writes in the CUDA kernels.
        tokens, pages = packed[:, TOKEN], packed[:, PAGES:]
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token id outside the vocabulary of {self.config.vocab_size}")
        if pages.min() < 0 or pages.max() >= self.pool.num_pages:
            raise ValueError(f"page id outside the pool's {self.pool.num_pages} pages")
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
