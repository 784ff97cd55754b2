"""The CUDA decode path: graphs replay the eager forward (the same logits bit for bit on
the same GPU and weights), one host-to-device copy a step, prefill against a dense forward."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.autograd import DeviceType

from libs.engine.config import ModelConfig
from libs.engine.engine import DecodeSeq, Engine, PrefillSeq
from libs.engine.graphs import DecodeGraphs, GraphOutOfMemory
from libs.engine.host_tokens import HostTokens
from libs.engine.kvpool import KvPool
from libs.engine.model import random_weights
from libs.engine.nvfp4 import quantize_layer_linears

from .helpers import dense_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _pair(config: ModelConfig, dtype: torch.dtype, nvfp4: bool = False, num_pages: int = 128,
          max_batch: int = 256) -> tuple[Engine, Engine]:
    """(eager, graphed) engines on the same GPU with the same weights."""
    w = random_weights(config, seed=7)
    if nvfp4:
        w = quantize_layer_linears(w)
    w = w.to("cuda", dtype)
    out = []
    for graphs in (False, True):
        pool = KvPool(config, num_pages, 16, device="cuda", dtype=dtype)
        out.append(Engine(config, w, pool, cuda_graphs=graphs, max_batch=max_batch))
    return out[0], out[1]


def _prompts(config: ModelConfig, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _greedy(eng: Engine, prompts: list[list[int]], steps: int):
    """Batched greedy decode of every prompt: (tokens [B][steps], logits [steps, B, V])."""
    seqs = []
    for p in prompts:
        pages = eng.pool.alloc(eng.pool.pages_for(len(p) + steps))
        logits = eng.prefill(p, pages)
        seqs.append(DecodeSeq(pages, len(p), int(logits.argmax())))
    tokens, all_logits = [[s.token] for s in seqs], []
    for _ in range(steps):
        logits = eng.decode_step(seqs)
        all_logits.append(logits.cpu())
        for s, row, out in zip(seqs, logits.argmax(-1).tolist(), tokens, strict=True):
            s.pos, s.token = s.pos + 1, row
            out.append(row)
    for s in seqs:
        eng.pool.free(s.pages)
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graph_greedy_equals_eager_smollm2_shape(dtype):
    config = ModelConfig.smollm2()
    eager, graphed = _pair(config, dtype)
    prompts = _prompts(config, [3, 17, 64, 100, 250])
    te, le = _greedy(eager, prompts, 24)
    tg, lg = _greedy(graphed, prompts, 24)
    assert tg == te
    assert graphed.graphs is not None and 8 in graphed.graphs.graphs  # 5 rows: bucket 8
    assert torch.equal(lg, le)  # the same kernels at the same padded shapes: the same bits


def test_graph_greedy_equals_eager_with_nvfp4_weights():
    """The NVFP4 linears' prepared launches are captured too (warmed up on the capture
    stream first)."""
    config = ModelConfig.smollm2()
    eager, graphed = _pair(config, torch.bfloat16, nvfp4=True)
    prompts = _prompts(config, [5, 40, 130])
    assert _greedy(graphed, prompts, 16)[0] == _greedy(eager, prompts, 16)[0]


def test_capture_at_start_and_a_batch_above_the_largest_bucket():
    config = ModelConfig.tiny()
    eager, graphed = _pair(config, torch.bfloat16, max_batch=4)
    assert graphed.capture_decode_graphs() == [1, 2, 4]
    assert eager.capture_decode_graphs() == []
    prompts = _prompts(config, [4, 9, 16, 17, 33, 2])  # 6 rows: replays of 4 and 2
    assert _greedy(graphed, prompts, 8)[0] == _greedy(eager, prompts, 8)[0]


def test_one_host_to_device_copy_a_step_and_no_sync():
    config = ModelConfig.tiny()
    _, eng = _pair(config, torch.bfloat16)
    seqs = []
    for p in _prompts(config, [10, 20, 30]):
        pages = eng.pool.alloc(eng.pool.pages_for(len(p) + 16))
        eng.prefill(p, pages)
        seqs.append(DecodeSeq(pages, len(p), 5))
    eng.decode_step(seqs)  # captures bucket 4
    torch.cuda.synchronize()
    steps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("decode_steps"):
            for _ in range(steps):
                eng.decode_step(seqs, copy=False)
        torch.cuda.synchronize()
    events = prof.events()
    names = [e.name for e in events]
    h2d = [n for n in names if "HtoD" in n]
    assert len(h2d) == steps, h2d
    assert not [n for n in names if "DtoH" in n]
    # No host call waits for the device inside the steps (the profiler's own exit and the
    # final synchronize are outside the range; waiting on the copy event is allowed).
    window = next(e for e in events if e.name == "decode_steps").time_range
    syncs = [e.name for e in events
             if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
             and window.start <= e.time_range.start <= window.end]
    assert syncs == []


def test_overlapped_steps_feed_from_the_device_and_never_wait_for_it():
    """As an overlapped decode runs them: each step's tokens are the previous step's
    sampled ids on the device (rows named -(j + 1)), its ids go to the host through
    HostTokens, and the host takes step N's ids only after launching step N+1. The
    tokens equal a serial greedy run's, and no launch synchronizes the stream or the
    device (a launch waits on one event, the previous rows' copy, long past by then)."""
    config = ModelConfig.tiny()
    eager, graphed = _pair(config, torch.bfloat16)
    prompts = _prompts(config, [7, 12, 30])
    steps = 6
    want = _greedy(eager, prompts, steps)[0]
    seqs = []
    for p in prompts:
        pages = graphed.pool.alloc(graphed.pool.pages_for(len(p) + steps))
        seqs.append(DecodeSeq(pages, len(p), int(graphed.prefill(p, pages).argmax())))
    got = [[s.token] for s in seqs]
    host = HostTokens()
    graphed.decode_step(seqs)  # captures the bucket before the profile
    torch.cuda.synchronize()
    fed, pending = None, None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("launch"):
                logits = graphed.decode_step(seqs, copy=False, fed=fed)
                fed = logits.argmax(-1)
                launched = host.start(fed)
            if pending is not None:
                for out, token in zip(got, pending.wait(), strict=True):
                    out.append(token)
            pending = launched
            for row, s in enumerate(seqs):
                s.pos, s.token = s.pos + 1, -(row + 1)
        for out, token in zip(got, pending.wait(), strict=True):
            out.append(token)
    assert got == want
    # the host's ranges only: the profiler also shows each range on the device's timeline
    launches = [e.time_range for e in prof.events()
                if e.name == "launch" and e.device_type == DeviceType.CPU]
    syncs = [e.name for e in prof.events()
             if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")
             and any(w.start <= e.time_range.start <= w.end for w in launches)]
    assert len(launches) == steps and syncs == []


def test_decode_from_a_worker_thread():
    """The batcher steps in worker threads: graphs captured in one replay in another."""
    config = ModelConfig.tiny()
    eager, graphed = _pair(config, torch.bfloat16)
    prompts = _prompts(config, [7, 12])
    want = _greedy(eager, prompts, 6)[0]
    got = []
    thread = threading.Thread(target=lambda: got.append(_greedy(graphed, prompts, 6)[0]))
    thread.start()
    thread.join()
    assert got == [want]
    assert _greedy(graphed, prompts, 6)[0] == want  # and back on the main thread


def test_capture_out_of_memory_names_the_flags():
    def forward(rows):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    graphs = DecodeGraphs(forward, "cuda", 8, 4)
    with pytest.raises(GraphOutOfMemory, match="--max-batch"):
        graphs.capture(4)


def _prefill_against_dense(eng: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged, dense) logits of a chunked then packed prefill: a 300-token prompt in a
    128-token chunk and a 172-token chunk packed with a 45-token prompt, against a plain
    causal forward over each whole prompt."""
    a, b = _prompts(eng.config, [300, 45])
    pa, pb = eng.pool.alloc(eng.pool.pages_for(300)), eng.pool.alloc(eng.pool.pages_for(45))
    first = eng.prefill(a[:128], pa)
    packed = eng.prefill_batch([PrefillSeq(a[128:], pa, 128), PrefillSeq(b, pb, 0)])
    ref_a, ref_b = dense_logits(eng, a), dense_logits(eng, b)
    got = torch.stack([first, packed[0], packed[1]]).cpu()
    return got, torch.stack([ref_a[127], ref_a[299], ref_b[44]]).cpu()


def test_prefill_matches_a_dense_forward_fp32():
    """Chunked and packed prefill on the GPU: SDPA over keys gathered from the pages the
    chunk wrote in place, the same logits as a dense forward."""
    got, want = _prefill_against_dense(_pair(ModelConfig.smollm2(), torch.float32)[1])
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_prefill_in_bf16_is_as_accurate_as_a_dense_bf16_forward():
    """In bf16 the paged and the dense forward round differently (other GEMM shapes, other
    attention kernels), and over 30 layers of random weights the differences grow past any
    fixed elementwise tolerance. So measure both against the exact answer, a dense fp32
    forward over the same (bf16-rounded) weights: the paged path's error is of the dense
    bf16 path's size. A wrong page, slot or mask is an error of the logits' own size."""
    config = ModelConfig.smollm2()
    w = random_weights(config, seed=7).to("cuda", torch.bfloat16)
    bf16 = Engine(config, w, KvPool(config, 128, 16, device="cuda", dtype=torch.bfloat16))
    fp32 = Engine(config, w.to("cuda", torch.float32),
                  KvPool(config, 128, 16, device="cuda", dtype=torch.float32))
    paged, dense = _prefill_against_dense(bf16)
    exact = _prefill_against_dense(fp32)[1]

    def error(x: torch.Tensor) -> float:
        return float((x.float() - exact).norm() / exact.norm())

    assert error(paged) <= 2 * error(dense) + 1e-2, (error(paged), error(dense))
    assert error(paged) < 0.5, error(paged)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("nvfp4", [False, True], ids=["native", "nvfp4"])
def test_gpu_smoke_graph_decode(nvfp4):
    config = ModelConfig.tiny()
    eager, graphed = _pair(config, torch.bfloat16, nvfp4=nvfp4, max_batch=8)
    prompts = _prompts(config, [5, 30, 61])
    tg, lg = _greedy(graphed, prompts, 8)
    te, le = _greedy(eager, prompts, 8)
    assert tg == te and torch.equal(lg, le)


@pytest.mark.gpu_smoke
def test_gpu_smoke_prefill():
    config = ModelConfig.tiny()
    eng = _pair(config, torch.float32)[1]
    (a,) = _prompts(config, [70])
    pages = eng.pool.alloc(eng.pool.pages_for(70))
    eng.prefill(a[:33], pages)
    last = eng.prefill(a[33:], pages, 33)
    torch.testing.assert_close(last.cpu(), dense_logits(eng, a)[-1].cpu(), atol=1e-3,
                               rtol=1e-3)
