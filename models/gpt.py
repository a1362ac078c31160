"""GPT: a decoder-only, causal Transformer with tied input/output embeddings (nanoGPT's shape, rotary
positions instead of a learned table), with a KV cache for generation (`prefill`, `extend`, `decode_step`,
`generate`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.kv_cache import KVCache
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
    "gpt2_small": GPTConfig(
        num_layers=12, num_heads=12, num_kv_heads=12, embed_dim=768, mlp_dim=3072, mlp="gelu", norm="layernorm"
    ),
}


class GPT(TiedTokenModel):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        super().__init__(config, is_causal=True, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """tokens int [batch, seq] -> next-token logits float32 [batch, seq, vocab_size]."""
        return self.logits(tokens, None, deterministic=deterministic)

    # ---- the KV cache: deterministic (no dropout) ----

    def init_cache(
        self,
        batch: int,
        max_len: int,
        *,
        page_size: int | None = None,
        block_table: jax.Array | None = None,
        num_pages: int | None = None,
    ) -> KVCache:
        """An empty `KVCache` for `batch` sequences of up to `max_len` tokens, in the compute dtype (paged with
        `page_size`; `block_table` and `num_pages` from `models.kv_cache.allocate_pages`, see `KVCache.create`)."""
        cfg = self.config
        return KVCache.create(
            num_layers=cfg.num_layers,
            batch=batch,
            max_len=max_len,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            value_head_dim=cfg.v_head_dim,
            dtype=jnp.dtype(cfg.dtype),
            page_size=page_size,
            block_table=block_table,
            num_pages=num_pages,
        )

    def _cached(self, tokens, cache: KVCache, step) -> tuple[jax.Array, KVCache]:
        x = self.embed_tokens(tokens)
        layers = []
        for block, layer in zip(self.stack.blocks, cache.layers):
            x, layer = block.cached(x, layer, step)
            layers.append(layer)
        return self.norm(x), cache._replace(layers=tuple(layers), lengths=step.lengths)

    def _head(self, x: jax.Array) -> jax.Array:
        table = self.embed.embedding[...].astype(jnp.float32)
        return jnp.einsum("...d,vd->...v", x.astype(jnp.float32), table)

    def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Runs prompts tokens int [batch, seq] (sequence b's first lengths[b] tokens; the rest is padding)
        from position 0 with causal attention (the configured one), writing their keys and values into an
        empty `cache`. Returns the logits float32 [batch, vocab_size] after each prompt's last token, and the
        cache holding `lengths` tokens per sequence."""
        if tokens.shape[1] > cache.capacity:
            raise ValueError(f"tokens have seq {tokens.shape[1]} > the cache's capacity {cache.capacity}")
        x, cache = self._cached(tokens, cache, cache.step(tokens.shape[1], prefill=True, lengths=lengths))
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        return self._head(last), cache

    def extend(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Appends a chunk tokens int [batch, chunk] (sequence b's first lengths[b] tokens; the rest is padding)
        after what `cache` holds (chunked prefill): the chunk's queries sit at positions cache.lengths onwards
        and attend causally to the cached keys and the chunk's own, with `flash_decode` (16 queries at a time).
        The chunk is written whole, so cache.lengths + chunk must fit the cache's capacity; its padding keys lie
        past the new lengths, where nothing sees them and later tokens overwrite them. Returns the logits float32
        [batch, vocab_size] after each sequence's last new token (a sequence with lengths[b] = 0 gets those of
        the chunk's first position: meaningless) and the cache holding cache.lengths + lengths tokens."""
        if tokens.shape[1] > cache.capacity:
            raise ValueError(f"tokens have seq {tokens.shape[1]} > the cache's capacity {cache.capacity}")
        held = cache.lengths
        x, cache = self._cached(tokens, cache, cache.step(tokens.shape[1], prefill=False))
        last = jnp.maximum(lengths - 1, 0).astype(jnp.int32)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        return self._head(x), cache._replace(lengths=held + lengths.astype(jnp.int32))

    def decode_step(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The next tokens int [batch, seq] (seq from 1 to 16: one token, or a speculative chunk) of each
        sequence, at positions cache.lengths onwards: their keys and values are appended to the cache and
        they attend to it with `flash_decode`. Returns logits float32 [batch, seq, vocab_size] and the cache."""
        x, cache = self._cached(tokens, cache, cache.step(tokens.shape[1], prefill=False))
        return self._head(x), cache

    def generate(
        self,
        prompt_tokens,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        rng: jax.Array | None = None,
        *,
        page_size: int | None = None,
        eos_token: int | None = None,
    ):
        """Sampled continuation of prompts, with a KV cache; the decode loop runs under one jit.

        Args:
          prompt_tokens: int [seq] (one prompt), [batch, seq], or a list of token lists (ragged prompts).
          max_new_tokens: tokens to generate per prompt; prompt + new tokens must fit max_seq_len.
          temperature: 0 is greedy (argmax); else logits / temperature are sampled.
          top_k: sample among the k most likely tokens only (None: all).
          rng: a JAX PRNG key (default: jax.random.key(0)).
          page_size: use a paged cache with pages of this many tokens (default: contiguous); each sequence
            gets the pages its prompt + max_new_tokens need (`models.kv_cache.allocate_pages`).
          eos_token: a token that ends a sequence (None: none does). A sequence stops after generating it;
            its later positions hold eos_token again (the padding), and the loop ends early once every
            sequence has stopped.
        Returns:
          The new tokens, int32 [max_new_tokens] for one prompt, else [batch, max_new_tokens]. With an
          eos_token, (tokens, lengths): lengths int32 [] or [batch], the tokens each sequence generated (its
          eos_token included; max_new_tokens where it never came).
        See `models.generate.generate` (prompts are padded to power-of-two buckets: no recompilation per
        prompt length within a bucket, nor per max_new_tokens within a cache bucket).
        """
        from models import generate

        return generate.generate(
            self,
            prompt_tokens,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            rng=rng,
            page_size=page_size,
            eos_token=eos_token,
        )
