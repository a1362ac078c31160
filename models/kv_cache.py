"""A KV cache for the decoder models: per layer, the keys and values of every token seen so far.

Contiguous ([batch, max_len, kv_heads, head_dim] per layer) or paged ([num_pages, page_size, kv_heads,
head_dim] per layer, with a block table [batch, pages_per_sequence] shared by the layers). A prefill writes a
prompt's keys and values from position 0 with `lax.dynamic_update_slice` (contiguous); a decode step or an
appended chunk writes each sequence's new tokens at its own length with `.at[].set` (a scatter). Inside a
jitted step that donates the cache, or a `lax.while_loop` carrying it, XLA updates the buffers in place:
nothing is copied.

Pages are allocated up front by `allocate_pages`: each sequence gets the pages its own budget of tokens (its
prompt plus the new tokens) needs, packed one after another into one pool, so a batch of ragged sequences does
not reserve max_len tokens each. A budget known before the decode loop starts is all generation needs (the
number of new tokens is fixed), and it keeps the loop free of allocation logic; the pool's size is bucketed to
a power of two so that new prompt lengths rarely recompile. Block table entries past a sequence's budget are
-1: writes there (a prompt's padding) are dropped, and `flash_decode` never reads them.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np
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
        num_pages, page_size = cache.shape[:2]
        slots = step.positions // page_size
        pages = jnp.take_along_axis(step.block_table, slots, axis=1, mode="clip")
        # A position past the table or in an unallocated page (-1) goes to page num_pages, which "drop" skips:
        # clipped or negative indices would overwrite another sequence's page.
        pages = jnp.where((slots < step.block_table.shape[1]) & (pages >= 0), pages, num_pages)
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
        value_head_dim: int | None = None,
        page_size: int | None = None,
        block_table: jax.Array | None = None,
        num_pages: int | None = None,
    ) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` tokens. With `page_size`, a pool of pages:
        either `num_pages` pages with a given `block_table` int32 [batch, ceil(max_len / page_size)] (from
        `allocate_pages`), or by default ceil(max_len / page_size) pages for each sequence (sequence b's i-th
        page is b * pages_per_sequence + i). Values have value_head_dim (None: head_dim)."""
        if page_size is None:
            shape = (batch, max_len, kv_heads, head_dim)
            table = None
        elif block_table is None:
            per_sequence = -(-max_len // page_size)
            shape = (batch * per_sequence, page_size, kv_heads, head_dim)
            table = jnp.arange(batch * per_sequence, dtype=jnp.int32).reshape(batch, per_sequence)
        else:
            if block_table.shape != (batch, -(-max_len // page_size)):
                raise ValueError(
                    f"block_table must have shape ({batch}, {-(-max_len // page_size)}), got {block_table.shape}"
                )
            shape = (num_pages, page_size, kv_heads, head_dim)
            table = jnp.asarray(block_table, jnp.int32)
        value_shape = shape[:-1] + (head_dim if value_head_dim is None else value_head_dim,)
        layers = tuple(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(value_shape, dtype)) for _ in range(num_layers))
        return cls(layers, jnp.zeros((batch,), jnp.int32), table)

    @property
    def capacity(self) -> int:
        """Tokens each sequence can hold."""
        keys = self.layers[0].keys
        return keys.shape[1] if self.block_table is None else self.block_table.shape[1] * keys.shape[1]

    def step(self, seq: int, *, prefill: bool, lengths: jax.Array | None = None) -> CacheStep:
        """The `CacheStep` of `seq` new tokens per sequence: from position 0 for a prefill (whose sequences
        hold `lengths` tokens afterwards), else after the tokens held (a decode step, or a chunk appended by
        `GPT.extend`, padding included, so that flash_decode's end-aligned queries sit on their positions)."""
        if prefill:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (self.lengths.shape[0], seq))
            return CacheStep(positions, lengths.astype(jnp.int32), self.block_table, True)
        positions = self.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
        return CacheStep(positions, self.lengths + seq, self.block_table, False)


def allocate_pages(tokens_per_sequence, page_size: int, max_len: int) -> tuple[np.ndarray, int]:
    """Pages for sequences that will hold tokens_per_sequence[b] tokens each (int [batch], on the host):
    (block_table int32 [batch, ceil(max_len / page_size)], num_pages). Sequence b gets ceil(tokens / page_size)
    consecutive pages of one pool after those of sequences 0..b-1; its table entries past them are -1. The pool
    holds the next power of two >= the pages handed out (fewer shapes to compile), at most batch * the table's
    width (what a contiguous cache of max_len tokens takes)."""
    tokens = np.asarray(tokens_per_sequence, np.int64)
    width = -(-max_len // page_size)
    if tokens.ndim != 1 or tokens.min(initial=0) < 0 or tokens.max(initial=0) > max_len:
        raise ValueError(f"tokens_per_sequence must be ints [batch] in [0, max_len={max_len}], got {tokens}")
    counts = -(-tokens // page_size)
    first = np.cumsum(counts) - counts
    slots = np.arange(width)[None, :]
    table = np.where(slots < counts[:, None], first[:, None] + slots, -1).astype(np.int32)
    used = int(counts.sum())
    num_pages = min(tokens.size * width, 1 << max(used - 1, 0).bit_length())
    return table, num_pages
