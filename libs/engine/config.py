"""Model shape: everything the engine and the KV pool need to know about a Llama-family model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    max_position: int
    tie_embeddings: bool
    bos_token_id: int
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads (GQA)")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def smollm2(cls) -> ModelConfig:
        """SmolLM2-135M-Instruct (what the GGUF's metadata says)."""
        return cls(
            name="smollm2", n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64,
            ffn_dim=1536, vocab_size=49152, rope_theta=100000.0, norm_eps=1e-5,
            max_position=8192, tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        )

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A toy shape that keeps SmolLM2's vocabulary so SmolLM2's tokenizer serves it."""
        return cls(
            name="tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
            ffn_dim=128, vocab_size=49152, rope_theta=10000.0, norm_eps=1e-5,
            max_position=2048, tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        )

    @classmethod
    def llama3_1b(cls) -> ModelConfig:
        """Llama-3.2-1B's shape. max_position is 16384, not the model's 131072: a member
        sizes its KV pool to hold at least one full context, and the benchmarks need 8k
        prompts plus their output, not 128k."""
        return cls(
            name="llama3-1b", n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, head_dim=64,
            ffn_dim=8192, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5,
            max_position=16384, tie_embeddings=True, bos_token_id=128000,
            eos_token_ids=(128001,),
        )

    @classmethod
    def llama3_8b(cls) -> ModelConfig:
        """Llama-3-8B's shape (max_position 16384: see llama3_1b)."""
        return cls(
            name="llama3-8b", n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128,
            ffn_dim=14336, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5,
            max_position=16384, tie_embeddings=False, bos_token_id=128000,
            eos_token_ids=(128001,),
        )
