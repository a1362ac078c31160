"""A bidirectional (BERT-style) encoder over token ids with a key-padding mask and a tied masked-LM head."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from models.transformer import TiedTokenModel, TransformerConfig, require_positive_ints


@dataclasses.dataclass(frozen=True)
class EncoderConfig(TransformerConfig):
    vocab_size: int = 256
    max_seq_len: int = 512  # validated against inputs; rotary embeddings have no table to size

    def __post_init__(self):
        super().__post_init__()
        require_positive_ints(self, "vocab_size", "max_seq_len")


PRESETS: dict[str, EncoderConfig] = {
    "tiny": EncoderConfig(num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=64, mlp_dim=128, max_seq_len=64),
    "small": EncoderConfig(
        num_layers=6, num_heads=8, num_kv_heads=8, embed_dim=512, mlp_dim=2048, mlp="gelu", norm="layernorm"
    ),
    "bert_base": EncoderConfig(
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        embed_dim=768,
        mlp_dim=3072,
        mlp="gelu",
        norm="layernorm",
        vocab_size=30522,
    ),
}


class Encoder(TiedTokenModel):
    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        super().__init__(config, is_causal=False, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, padding_mask: jax.Array | None = None, *, deterministic: bool = True
    ) -> jax.Array:
        """tokens int [batch, seq], padding_mask bool [batch, seq] (True = a real token) ->
        masked-LM logits float32 [batch, seq, vocab_size]. No token attends to padding; the logits at
        padded positions are finite and meaningless."""
        mask = None
        if padding_mask is not None:
            if padding_mask.shape != tokens.shape:
                raise ValueError(
                    f"padding_mask has shape {tuple(padding_mask.shape)}; tokens have {tuple(tokens.shape)}"
                )
            mask = padding_mask.astype(bool)[:, None, None, :]  # [batch, 1 (heads), 1 (queries), seq]
        return self.logits(tokens, mask, deterministic=deterministic)
