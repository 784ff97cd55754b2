"""pdmesh inference engine: a plain-torch Llama over a paged KV pool (prefill/decode steps)."""

from .config import ModelConfig
from .engine import DecodeSeq, Engine, PrefillSeq
from .generate import generate
from .kvpool import KvPool, PoolExhausted
from .loader import LoadedModel, load_model
from .model import Weights
from .sampling import SamplingParams, request_seed, sample, sample_batch
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "DecodeSeq", "Engine", "IncrementalDetokenizer", "KvPool", "LoadedModel", "ModelConfig",
    "PoolExhausted", "PrefillSeq", "SamplingParams", "Tokenizer", "Weights", "generate",
    "load_model", "request_seed", "sample", "sample_batch",
]
