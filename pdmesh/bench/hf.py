"""The baseline a user would otherwise run: transformers ``generate`` on the same weights.

``smollm2`` is transformers' own Llama read by transformers' own GGUF reader (the
engine's reference, libs/engine/hf_reference.py); every other spec (random weights,
tiny, a GGUF or HF directory) is a transformers ``LlamaForCausalLM`` given the engine's
own loaded weights, so a GPU machine without the checkpoint runs the baseline too.

``generate`` batches statically: `serve` hands it every request that has arrived (at
most the workload's concurrency) as one left-padded batch, and the next batch starts when
that one ends. A streamer stamps each step as it reaches the host (it does ``.cpu()``, so
the stamps are real on a GPU too).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from pdmesh.bench.progress import Progress
from pdmesh.bench.workload import Record, Request, Workload


def load_transformers(spec: str, device: str, dtype: torch.dtype):
    if spec == "smollm2":
        from libs.engine.hf_reference import load_hf_reference

        model = load_hf_reference()
    else:
        from libs.engine.loader import load_model

        loaded = load_model(spec, "cpu", torch.float32, "native")
        model = llama_from_weights(loaded.config, loaded.weights)
    return model.to(device, dtype).eval()


def llama_from_weights(config, weights):
    """A transformers Llama holding the engine's weights (fused q/k/v and gate/up split
    back into HF's projections; both use HF's rotate-half RoPE layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    hf = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position, rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids),
    )
    model = LlamaForCausalLM(hf)
    state = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm,
             "lm_head.weight": weights.lm_head}
    for i, lw in enumerate(weights.layers):
        q, k, v = lw.wqkv.split([c.q_dim, c.kv_dim, c.kv_dim], 0)
        gate, up = lw.w_gate_up.chunk(2, 0)
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": lw.attn_norm,
            p + "post_attention_layernorm.weight": lw.ffn_norm,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": lw.wo,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": lw.w_down,
        }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model


class _Stamps:
    """A generate streamer (duck-typed: generate only calls put and end): when each step's
    tokens reached the host (the first put is the prompt), and the tokens themselves."""

    def __init__(self, clock, progress: Progress, batch: int) -> None:
        self.clock, self.progress, self.batch = clock, progress, batch
        self.calls = 0
        self.times: list[float] = []
        self.tokens: list[list[int]] = []

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(self.clock())
            self.tokens.append(value.view(-1).tolist())
            self.progress.add(tokens=self.batch)

    def end(self) -> None:
        pass


def generate_batch(model, batch: list[Request], pad: int, clock, progress: Progress) -> _Stamps:
    """One left-padded greedy ``generate`` of every request to the longest output asked."""
    device = next(model.parameters()).device
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch],
                       device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                         for r in batch], device=device)
    n = max(r.output_tokens for r in batch)
    stamps = _Stamps(clock, progress, len(batch))
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad, streamer=stamps)
    assert len(stamps.times) == n, f"the streamer saw {len(stamps.times)} steps, not {n}"
    return stamps


def serve(model, pad: int, workload: Workload, progress: Progress) -> list[Record]:
    """Serve ``workload`` in static batches: whatever has arrived, at most its concurrency
    (an open-loop workload: everything that has arrived)."""
    start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - start

    reqs = workload.requests
    records: list[Record | None] = [None] * len(reqs)
    if workload.rate:
        due = deque(zip(workload.arrivals(), reqs, strict=True))
        later: deque[Request] = deque()
        limit = len(reqs)
    else:
        due = deque((0.0, r) for r in reqs[: workload.concurrency])
        later = deque(reqs[workload.concurrency:])
        limit = workload.concurrency
    while due:
        t = now()
        if due[0][0] > t:
            time.sleep(due[0][0] - t)
            continue
        batch: list[tuple[float, Request]] = []
        while due and due[0][0] <= t and len(batch) < limit:
            batch.append(due.popleft())
        stamps = generate_batch(model, [r for _, r in batch], pad, now, progress)
        ends = []
        for row, (sent, r) in enumerate(batch):
            times = stamps.times[: r.output_tokens]
            records[r.index] = Record(sent, [(t, 1) for t in times],
                                      [step[row] for step in stamps.tokens[: r.output_tokens]])
            ends.append(times[-1])
            progress.add(done=1)
        for end in sorted(ends):  # closed loop: each request that ended lets the next one in
            if later:
                due.append((end, later.popleft()))
    return records
