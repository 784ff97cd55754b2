"""Shared fixtures: the SmolLM2 tokenizer and small random-weight engines."""

from __future__ import annotations

import os

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.engine import Engine
from libs.engine.kvpool import KvPool
from libs.engine.loader import smollm2_gguf_path
from libs.engine.model import random_weights
from libs.engine.tokenizer import Tokenizer


@pytest.fixture(scope="package", autouse=True)
def _one_thread_unless_passive_omp():
    """On a shared, oversubscribed box OpenMP's default spin-waiting slows these small-op tests
    ~10x (minutes instead of one for this package). OMP_WAIT_POLICY=PASSIVE fixes it but must
    be set before torch loads; failing that, run this package single-threaded."""
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(smollm2_gguf_path(), (2,))


def small_config(vocab: int = 512) -> ModelConfig:
    """A tiny shape with a small vocabulary: engine math tests need no tokenizer."""
    return ModelConfig(
        name="test", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
        vocab_size=vocab, rope_theta=10000.0, norm_eps=1e-5, max_position=512,
        tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )


def make_engine(num_pages: int = 64, page_size: int = 16, seed: int = 0, device: str = "cpu"):
    cfg = small_config()
    weights = random_weights(cfg, seed).to(device, torch.float32)
    pool = KvPool(cfg, num_pages, page_size, device=device, dtype=torch.float32)
    return Engine(cfg, weights, pool)
