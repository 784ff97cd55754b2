"""Device kernels per transformer layer of a decode step and a prefill, counted on the CPU.

Why: on CUDA a decode step's fixed cost is its number of kernels (each ~2 us even inside a
CUDA graph), so the layer's kernel count is the figure to drive down, and it can be
counted without a GPU: the engine runs the same layer code on CPU tensors under
torch.profiler, and every aten op that would be a device kernel is counted.

The rule. An event counts if it is an aten op with no aten op above it (a composite such
as aten::linear counts once, not again for the addmm under it), and it is not
metadata-only: views, reshapes, slicing, allocation (aten::empty*) never launch a kernel;
aten::to, contiguous, reshape and clone-like composites count only when they did work (an
aten op ran under them). A fused Triton kernel (libs/kernels/fused_layer.py, run by
Triton's interpreter here with ``--fused``) counts as one, whatever the interpreter does
inside it. Attention (DecodeAttention / PrefillAttention calls) is counted apart: on CPU
it is torch's gather-and-matmul path, on CUDA it is the Triton paged kernels
(libs/kernels/paged_attention.py: store_kv and the attention, 2-3 kernels), so its CPU
count says little about the GPU.

Per layer = (ops of the model with L layers - ops of the same model with 1 layer) /
(L - 1), so what a step does once (embedding, indices, final norm, lm_head) is apart:
"step" = the 1-layer model's ops minus one layer.

    python -m bench.layer_ops [--spec random:smollm2] [--dtype bfloat16] [--fused]
        [--batch 4] [--prompt 64]

``--fused`` runs the Triton kernels as CUDA does (model.FUSED_KERNELS = True, under
TRITON_INTERPRET=1); without it the CPU's torch ops run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from dataclasses import replace

METADATA = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::slice", "aten::select",
    "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::unbind",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::expand_as",
    "aten::transpose", "aten::permute", "aten::t", "aten::detach", "aten::alias",
    "aten::view_as", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::result_type",
    "aten::_reshape_alias", "aten::numpy_T", "aten::flatten",
}
# Composites that are free when they have nothing to do (already that dtype, contiguous).
MAYBE_FREE = {"aten::to", "aten::contiguous", "aten::reshape", "aten::type_as",
              "aten::_to_copy", "aten::clone"}
KERNEL_RANGE, ATTENTION_RANGE = "triton::", "pdmesh::attention"


def kernels(events) -> tuple[Counter, Counter]:
    """(layer ops, attention ops) by name, under the rule of the module docstring."""
    layer, attention = Counter(), Counter()
    for e in events:
        if e.name.startswith(KERNEL_RANGE):
            layer[e.name] += 1
            continue
        if not e.name.startswith("aten::") or e.name in METADATA:
            continue
        parents, p = [], e.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        if any(n.startswith("aten::") or n.startswith(KERNEL_RANGE) for n in parents):
            continue
        if e.name in MAYBE_FREE and not any(c.name.startswith("aten::")
                                            for c in e.cpu_children):
            continue
        (attention if ATTENTION_RANGE in parents else layer)[e.name] += 1
    return layer, attention


def _ranged(fn, name: str):
    import torch

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def _marked(fused: bool):
    """Attention calls, and each fused kernel, inside a named profiler range."""
    from libs.engine import attention

    saved = [(cls, cls.__call__) for cls in (attention.DecodeAttention,
                                            attention.PrefillAttention)]
    patched = []
    for cls, call in saved:
        cls.__call__ = _ranged(call, ATTENTION_RANGE)
    if fused:
        from libs.kernels import fused_layer

        for name in ("rms_norm", "add_rms_norm", "rope_qk", "silu_mul"):
            patched.append((name, getattr(fused_layer, name)))
            setattr(fused_layer, name, _ranged(getattr(fused_layer, name), KERNEL_RANGE + name))
    try:
        yield
    finally:
        for cls, call in saved:
            cls.__call__ = call
        if fused:
            for name, fn in patched:
                setattr(fused_layer, name, fn)


def count(config, dtype, fused: bool, batch: int, prompt: int) -> dict[str, tuple]:
    """{"decode": (layer ops, attention ops), "prefill": ...} of one step each."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from libs.engine import model
    from libs.engine.engine import DecodeSeq, Engine
    from libs.engine.kvpool import KvPool

    if fused:
        model.FUSED_KERNELS = True
    weights = model.random_weights(config, seed=0).to("cpu", dtype)
    pool = KvPool(config, 4 * batch + 8, 16, dtype=dtype)
    engine = Engine(config, weights, pool)
    prompt_tokens = list(range(3, 3 + prompt))
    seqs = []
    for _ in range(batch):
        pages = pool.alloc(pool.pages_for(prompt + 1))
        engine.prefill(prompt_tokens, pages)
        seqs.append(DecodeSeq(pages, prompt, 5))
    out = {}
    with torch.inference_mode(), _marked(fused):
        for what, run in (("decode", lambda: engine.decode_step(seqs)),
                          ("prefill", lambda: engine.prefill(prompt_tokens, seqs[0].pages))):
            run()  # warm: first-call work is not a step's
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            out[what] = kernels(prof.events())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="random:smollm2")
    ap.add_argument("--dtype", default="bfloat16", help="the GPU's dtype: its casts count")
    ap.add_argument("--fused", action="store_true", help="the CUDA path's fused kernels")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--names", action="store_true", help="list each layer's ops by name")
    args = ap.parse_args()
    if args.fused:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    from libs.engine.specs import random_config

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    config = random_config(args.spec)
    dtype = getattr(torch, args.dtype)
    full = count(config, dtype, args.fused, args.batch, args.prompt)
    one = count(replace(config, n_layers=1), dtype, args.fused, args.batch, args.prompt)
    n = config.n_layers
    print(f"{args.spec} ({n} layers) {args.dtype} {'fused' if args.fused else 'torch ops'}")
    for what in ("decode", "prefill"):
        (layer_l, attn_l), (layer_1, attn_1) = full[what], one[what]
        per_layer = (layer_l - layer_1).total() / (n - 1)
        attn = (attn_l - attn_1).total() / (n - 1)
        step = layer_1.total() - per_layer
        print(f"  {what}: {per_layer:g} kernels a layer besides attention, attention "
              f"{attn:g} (CPU path), {step:g} once a step")
        if args.names:
            diff = layer_l - layer_1
            print("    " + ", ".join(f"{k.removeprefix('aten::')} {v / (n - 1):g}"
                                      for k, v in diff.most_common()))


if __name__ == "__main__":
    main()
