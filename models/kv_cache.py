"""A KV cache for the decoder models: per layer, the keys and values of every token seen so far.

Contiguous ([batch, max_len, kv_heads, head_dim] per layer) or paged ([num_pages, page_size, kv_heads,
head_dim] per layer, with a block table [batch, pages_per_sequence] shared by the layers). A prefill writes a
prompt's keys and values from position 0 with `lax.dynamic_update_slice` (contiguous); a decode step writes
each sequence's new tokens at its own length with `.at[].set` (a scatter). Inside a jitted step that donates
the cache, or a `lax.while_loop` carrying it, XLA updates the buffers in place: nothing is copied.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
from jax import lax


class CacheStep(typing.NamedTuple):
    """Where one forward pass over new tokens x [batch, seq] sits: positions int32 [batch, seq] (absolute,
    for rotary embeddings and the cache writes), lengths int32 [batch] (keys held once they are written),
    block_table (paged caches) or None, and prefill (static: x starts at position 0 and attends to itself)."""

    positions: jax.Array
    lengths: jax.Array
    block_table: jax.Array | None
    prefill: bool


class LayerCache(typing.NamedTuple):
    """One layer's keys and values."""

    keys: jax.Array
    values: jax.Array

    def write(self, k: jax.Array, v: jax.Array, step: CacheStep) -> LayerCache:
        """The cache with k, v [batch, seq, kv_heads, head_dim] stored at `step.positions`."""
        return LayerCache(_write(self.keys, k, step), _write(self.values, v, step))


def _write(cache, new, step: CacheStep):
    new = new.astype(cache.dtype)
    batch, seq = new.shape[:2]
    if step.block_table is not None:
        page_size = cache.shape[1]
        pages = jnp.take_along_axis(step.block_table, step.positions // page_size, axis=1, mode="clip")
        return cache.at[pages, step.positions % page_size].set(new, mode="drop")
    if step.prefill:  # every sequence from position 0
        return lax.dynamic_update_slice(cache, new, (0, 0, 0, 0))
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq))
    return cache.at[rows, step.positions].set(new, mode="drop")


class KVCache(typing.NamedTuple):
    """The cache of a whole model (a pytree): per-layer `LayerCache`s, lengths int32 [batch] (tokens held
    per sequence) and, for a paged cache, block_table int32 [batch, pages_per_sequence]."""

    layers: tuple
    lengths: jax.Array
    block_table: jax.Array | None = None

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        page_size: int | None = None,
    ) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` tokens. With `page_size`, each sequence
        gets ceil(max_len / page_size) pages of its own (page ids in the block table: sequence b's i-th page
        is b * pages_per_sequence + i)."""
        if page_size is None:
            shape = (batch, max_len, kv_heads, head_dim)
            table = None
        else:
            per_sequence = -(-max_len // page_size)
            shape = (batch * per_sequence, page_size, kv_heads, head_dim)
            table = jnp.arange(batch * per_sequence, dtype=jnp.int32).reshape(batch, per_sequence)
        layers = tuple(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
        return cls(layers, jnp.zeros((batch,), jnp.int32), table)

    @property
    def capacity(self) -> int:
        """Tokens each sequence can hold."""
        keys = self.layers[0].keys
        return keys.shape[1] if self.block_table is None else self.block_table.shape[1] * keys.shape[1]

    def step(self, seq: int, *, prefill: bool, lengths: jax.Array | None = None) -> CacheStep:
        """The `CacheStep` of `seq` new tokens per sequence: from position 0 for a prefill (whose sequences
        hold `lengths` tokens afterwards), else after the tokens held."""
        if prefill:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (self.lengths.shape[0], seq))
            return CacheStep(positions, lengths.astype(jnp.int32), self.block_table, True)
        positions = self.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
        return CacheStep(positions, self.lengths + seq, self.block_table, False)
