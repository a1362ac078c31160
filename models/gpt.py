"""GPT: a decoder-only, causal Transformer with tied input/output embeddings (nanoGPT's shape, rotary
positions instead of a learned table)."""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from models.transformer import TiedTokenModel, TransformerConfig, require_positive_ints


@dataclasses.dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    """A GPT. `attention` picks "flash", "dense" or a callable; parameters are the same for every choice,
    so `dataclasses.replace(cfg, attention="dense")` runs the same checkpoint densely."""
    vocab_size: int = 256  # byte-level
    max_seq_len: int = 1024  # validated against inputs; rotary embeddings have no table to size

    def __post_init__(self):
        super().__post_init__()
        require_positive_ints(self, "vocab_size", "max_seq_len")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, mlp_dim=128, max_seq_len=64),
    "small": GPTConfig(num_layers=6, num_heads=8, num_kv_heads=8, embed_dim=512, mlp_dim=1408),
    "gpt2_small": GPTConfig(num_layers=12, num_heads=12, num_kv_heads=12, embed_dim=768, mlp_dim=3072,
                            mlp="gelu", norm="layernorm"),
}


class GPT(TiedTokenModel):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        super().__init__(config, is_causal=True, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """tokens int [batch, seq] -> next-token logits float32 [batch, seq, vocab_size]."""
        return self.logits(tokens, None, deterministic=deterministic)
