"""prepare_nvfp4_linear (libs/kernels/nvfp4/prepared.py): the same output as nvfp4_linear,
bit for bit, with the host work done once per x signature; the same errors for bad input.
CPU tests run everywhere; the bound launches need a GPU (`gpu`)."""

import pytest
import torch

from libs.kernels import nvfp4_linear, prepare_nvfp4_linear, quantize_nvfp4

from .nvfp4_helpers import cuda_weight

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cpu_weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=g))


@pytest.mark.parametrize("shape", [(3, 64), (2, 1, 64), (1, 64), (5, 7, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_equals_nvfp4_linear(shape, with_bias):
    p, s, g = cpu_weight(48, 64, seed=1)
    bias = torch.randn(48) if with_bias else None
    f = prepare_nvfp4_linear(p, s, g, bias)
    for seed in range(3):  # fresh values through the same signature
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(f(x), nvfp4_linear(x, p, s, g, bias))


def test_bad_x_raises_what_nvfp4_linear_raises():
    p, s, g = cpu_weight(16, 64, seed=2)
    f = prepare_nvfp4_linear(p, s, g)
    for bad, kind in ((torch.randn(2, 48), ValueError), (torch.ones(2, 64, dtype=torch.int32),
                                                         TypeError)):
        with pytest.raises(kind) as ours:
            f(bad)
        with pytest.raises(kind) as theirs:
            nvfp4_linear(bad, p, s, g)
        assert str(ours.value) == str(theirs.value)


def test_bad_weight_raises_at_prepare():
    p, s, g = cpu_weight(16, 64, seed=3)
    with pytest.raises(ValueError, match="contiguous"):
        prepare_nvfp4_linear(p.t(), s, g)
    with pytest.raises(ValueError, match="2-D"):
        prepare_nvfp4_linear(p[None], s[None], g)
    with pytest.raises(ValueError, match="positive and finite"):
        prepare_nvfp4_linear(p, s, -1.0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        prepare_nvfp4_linear(p, s.view(torch.uint8), g)


# SmolLM2's fused layers as the engine runs them, and a GEMV layer; token counts of decode
# batches and of prompts: every route (X_REGS and TMA small kernel, phased kernel, Triton
# kernel, GEMV, dequantize, and the GEMM: planned, split in K, and padding x unplanned).
GPU_LAYERS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 4096)]
GPU_TOKENS = [1, 3, 8, 16, 32, 33, 64, 65, 256, 512, 1024]


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", GPU_LAYERS)
def test_gpu_equals_nvfp4_linear_bit_for_bit(n, k):
    packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=n + k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for b in (None, bias):
        f = prepare_nvfp4_linear(packed, scales, s2, b)
        for m in GPU_TOKENS:
            kept = []
            for seed in range(3):  # the first call plans, the next ones replay
                g = torch.Generator(device="cuda").manual_seed(seed)
                x = torch.randn(m, 1, k, device="cuda", dtype=torch.bfloat16, generator=g)
                y = f(x)
                assert y.shape == (m, 1, n)
                assert torch.equal(y, nvfp4_linear(x, packed, scales, s2, b)), (m, seed)
                kept.append((x, y))
            for x, y in kept:  # each call had its own output, not one buffer reused
                assert torch.equal(y, nvfp4_linear(x, packed, scales, s2, b))


@gpu
@needs_cuda
def test_gpu_decode_calls_skip_the_launch_cache(monkeypatch):
    """After the planning call, a decode-sized call launches without the launch cache:
    the replay path is what runs, and it is exact."""
    from libs.kernels.nvfp4 import launch_cache

    calls = []
    original = launch_cache.LaunchCache.__call__
    monkeypatch.setattr(launch_cache.LaunchCache, "__call__",
                        lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    for n, k in ((960, 576), (576, 1536), (4096, 4096)):  # small X_REGS, Triton, GEMV
        packed, scales, s2 = cuda_weight(n, k, torch.float16, seed=5)
        f = prepare_nvfp4_linear(packed, scales, s2)
        x = torch.randn(2, k, device="cuda", dtype=torch.float16)
        f(x)
        planned = len(calls)
        assert planned >= 1
        for _ in range(4):
            x = torch.randn(2, k, device="cuda", dtype=torch.float16)
            assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2))
        # nvfp4_linear went through the cache 4 times; the prepared calls never did
        assert len(calls) == planned + 4, (n, k)


@gpu
@needs_cuda
@pytest.mark.parametrize("n, k, m, route", [
    (3072, 576, 256, "small"),           # x by TMA
    (576, 1536, 128, "small_phased"),    # x by TMA, in boxes of four chunks
    (576, 1280, 32, "small_phased"),     # one box of 32 token rows
    (576, 1536, 32, "triton"),           # few_tokens: split K, the stream's workspace
    (576, 1536, 512, "gemm"),            # x and out by TMA
    (4096, 4096, 64, "gemm"),            # split K: the stream's shared workspace
])
def test_gpu_prompt_calls_skip_the_launch_cache(monkeypatch, n, k, m, route):
    """Prompt-sized calls on the TMA routes replay too: new descriptors for each x (and
    the GEMM's out), the compiled kernel launched directly, and the result exact."""
    from libs.kernels.nvfp4 import launch_cache, linear

    packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=7)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    assert linear.route(x[0], packed, scales, torch.empty(m, n, device="cuda",
                                                      dtype=torch.bfloat16))[0] == route
    calls = []
    original = launch_cache.LaunchCache.__call__
    monkeypatch.setattr(launch_cache.LaunchCache, "__call__",
                        lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    f = prepare_nvfp4_linear(packed, scales, s2)
    f(x)
    planned = len(calls)
    for seed in range(3):
        x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(seed))
        assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2))
    assert len(calls) == planned + 3  # nvfp4_linear's three; the prepared calls none


@gpu
@needs_cuda
def test_gpu_dequantize_route_replays_without_the_jit(monkeypatch):
    """The dequantize route's plan launches the compiled dequantize directly: after the
    planning call no call reaches the JIT, and the output is nvfp4_linear's."""
    from libs.kernels.nvfp4 import dequantize_kernel, linear

    n, k, m = 3072, 576, 512
    packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=9)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert linear.route(x, packed, scales, torch.empty(m, n, device="cuda",
                                                   dtype=torch.bfloat16))[0] == "dequantize"
    # no compiled launch from an earlier test in this process: the binding call's own
    monkeypatch.setattr(dequantize_kernel._DEQUANTIZE_LAUNCHES, "entries", {})
    runs = []
    kernel = dequantize_kernel._dequantize_kernel
    original = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: runs.append(1) or original(*a, **kw))
    f = prepare_nvfp4_linear(packed, scales, s2, bias)
    f(x)
    planned = len(runs)
    assert planned == 1  # the binding call compiled (or found) the kernel through the JIT
    for seed in range(3):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(seed))
        assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2, bias))
    assert len(runs) == planned + 3  # nvfp4_linear's three; the prepared calls none
    packed.view(torch.uint8)[0, 0] ^= 0x77  # the weight is read at each call
    assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2, bias))


@gpu
@needs_cuda
def test_gpu_gemm_calls_that_pad_x_stay_unplanned_and_exact():
    from libs.kernels.nvfp4 import gemm_configs, linear

    packed, scales, s2 = cuda_weight(4096, 4096, torch.bfloat16, seed=10)
    f = prepare_nvfp4_linear(packed, scales, s2)
    # under one 128-token tile x is copied (not planned); past one the last tile moves back
    for m, planned in ((100, False), (200, True), (256, True)):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        kernel, cfg = linear.route(x, packed, scales, torch.empty(m, 4096, device="cuda",
                                                                dtype=torch.bfloat16))
        assert kernel == "gemm" and gemm_configs.needs_pad(m, cfg) != planned
        for _ in range(2):
            assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2))
        assert (list(f._plans.values())[-1] is not None) == planned, m


@gpu
@needs_cuda
def test_gpu_two_launch_gemm_calls_are_planned_and_equal():
    from libs.kernels.nvfp4 import linear

    packed, scales, s2 = cuda_weight(8192, 2048, torch.bfloat16, seed=11)
    bias = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    f = prepare_nvfp4_linear(packed, scales, s2, bias)
    # 44 tokens past 256 run in a 64-token tile (planned: two bound launches); 74 past,
    # in a 128-token tile whose x is copied first (not planned)
    for m, planned in ((300, True), (330, False)):
        x = torch.randn(2, m // 2, 2048, device="cuda", dtype=torch.bfloat16)
        kernel, cfg = linear.route(x.view(m, 2048), packed, scales,
                               torch.empty(m, 8192, device="cuda", dtype=torch.bfloat16))
        assert kernel == "gemm" and cfg["HEAD"] == 256
        for _ in range(3):
            assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2, bias))
        assert (list(f._plans.values())[-1] is not None) == planned, m


@gpu
@needs_cuda
def test_gpu_plans_keep_no_input_or_output_alive():
    """A plan keeps the weight's tensors, not the tensors of the call that made it: with
    prompts a plan a chunk length, holding them would pin megabytes a layer."""
    import gc
    import weakref

    for n, k, m in ((3072, 576, 256), (576, 1536, 128), (960, 576, 4), (576, 1536, 512),
                    (3072, 576, 512)):
        packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=8)
        f = prepare_nvfp4_linear(packed, scales, s2)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = f(x)
        refs = [weakref.ref(x), weakref.ref(y)]
        f(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))  # the plan replays
        del x, y
        gc.collect()
        assert [r() for r in refs] == [None, None], (n, k, m)


@gpu
@needs_cuda
def test_gpu_misaligned_x_and_other_streams_get_their_own_plans():
    packed, scales, s2 = cuda_weight(576, 1536, torch.bfloat16, seed=6)  # split-K at 1 token
    f = prepare_nvfp4_linear(packed, scales, s2)
    wide = torch.randn(4, 1544, device="cuda", dtype=torch.bfloat16)
    for x in (wide[:, :1536], wide[:, 1:1537], wide[:1, 8:1544], wide[:1, 1:1537]):
        for _ in range(2):
            assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2))
    streams = [torch.cuda.Stream() for _ in range(2)]
    xs = [torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16) for _ in streams]
    torch.cuda.synchronize()
    outs = []
    for _ in range(3):
        for s, x in zip(streams, xs, strict=True):
            with torch.cuda.stream(s):
                outs.append((x, f(x)))
    torch.cuda.synchronize()
    for x, y in outs:
        assert torch.equal(y, nvfp4_linear(x, packed, scales, s2))
    assert len(f._plans) >= 6  # four x signatures on the default stream, two streams more


@gpu
@needs_cuda
def test_gpu_fp32_and_empty_inputs_take_nvfp4_linear():
    packed, scales, s2 = cuda_weight(576, 576, torch.bfloat16, seed=7)
    f = prepare_nvfp4_linear(packed, scales, s2)
    x = torch.randn(2, 576, device="cuda")
    assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2))
    empty = torch.empty(0, 576, device="cuda", dtype=torch.bfloat16)
    assert f(empty).shape == (0, 576)


@gpu
@needs_cuda
def test_gpu_split_k_plans_share_one_workspace_a_stream_and_stay_exact():
    """Bound split-K launches take the stream's shared workspace, not one each (which would
    hold memory per weight and token count); calls of two weights interleaved on one
    stream still give each its exact output."""
    from libs.kernels.nvfp4 import common

    weights = [cuda_weight(576, 1536, torch.bfloat16, seed=s) for s in (8, 9)]
    fs = [prepare_nvfp4_linear(*w) for w in weights]
    outs = []
    for m in (1, 2, 5, 16):  # the Triton kernel with K split, at every one of these
        for f, w in zip(fs, weights, strict=True):
            x = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)
            outs.append((x, w, f(x), f(x)))
    for x, w, first, again in outs:
        expected = nvfp4_linear(x, *w)
        assert torch.equal(first, expected) and torch.equal(again, expected)
    workspaces = {plan.launch.args[6].untyped_storage().data_ptr()
                  for f in fs for plan in f._plans.values() if plan is not None}
    assert len(workspaces) == 1
    assert all(6 not in plan.launch.out_at for f in fs for plan in f._plans.values())
    assert any(buf.untyped_storage().data_ptr() in workspaces
               for buf in common._workspaces.values())
