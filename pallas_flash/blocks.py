"""Tile geometry every kernel family shares: which key blocks a query block visits (and which of them need the
mask), the transpose of that for the backward, and the exp2-domain constants of the online softmax."""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_flash import masks

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def kv_block_range(
    q_block, *, block_q: int, block_kv: int, num_kv_blocks: int, kv_len: int, band: masks.Band, always_mask: bool
):
    """Key blocks a query block visits: lo <= unmasked_lo <= unmasked_hi <= hi. Blocks outside [lo, hi) are
    invisible to every row and never loaded; [unmasked_lo, unmasked_hi) are visible to every row and skip
    the mask; the rest need it. (Only min/max and non-negative floor division: the Triton lowering cannot
    select between scalars.)"""
    q_first = q_block * block_q
    q_last = q_first + block_q - 1
    lo, hi = 0, num_kv_blocks
    if band.left is not None:
        lo = jnp.minimum(jnp.maximum(q_first - band.left, 0) // block_kv, num_kv_blocks)
    if band.right is not None:
        hi = jnp.maximum(jnp.minimum((q_last + band.right) // block_kv + 1, num_kv_blocks), lo)
    unmasked_lo = lo
    if band.left is not None:  # first block whose first key is visible to the last row
        unmasked_lo = _clip((jnp.maximum(q_last - band.left, 0) + block_kv - 1) // block_kv, lo, hi)
    unmasked_hi = kv_len // block_kv  # blocks free of padded keys
    if band.right is not None:  # blocks whose last key is visible to the first row
        unmasked_hi = jnp.minimum((q_first + band.right + 1) // block_kv, unmasked_hi)
    unmasked_hi = unmasked_lo if always_mask else _clip(unmasked_hi, unmasked_lo, hi)
    return lo, unmasked_lo, unmasked_hi, hi


def q_block_range(
    kv_block, *, block_q: int, block_kv: int, num_q_blocks: int, kv_len: int, band: masks.Band, always_mask: bool
):
    """Query blocks that see a key block, in the same form as `kv_block_range`."""
    k_first = kv_block * block_kv
    k_last = k_first + block_kv - 1
    lo, hi = 0, num_q_blocks
    if band.right is not None:  # rows r see key k only if r >= k - right
        lo = jnp.minimum(jnp.maximum(k_first - band.right, 0) // block_q, num_q_blocks)
    if band.left is not None:  # ... and r <= k + left
        hi = jnp.maximum(jnp.minimum((k_last + band.left) // block_q + 1, num_q_blocks), lo)
    unmasked_lo = lo
    if band.right is not None:  # first block whose first row sees the block's last key
        unmasked_lo = _clip((jnp.maximum(k_last - band.right, 0) + block_q - 1) // block_q, lo, hi)
    unmasked_hi = hi
    if band.left is not None:  # blocks whose last row sees the block's first key
        unmasked_hi = jnp.minimum((k_first + band.left + 1) // block_q, hi)
    if always_mask:
        unmasked_hi = unmasked_lo
    elif kv_len % block_kv:
        # The block holding the padded key tail needs the mask for every query block.
        holds_tail = _clip(kv_block - kv_len // block_kv + 1, 0, 1)
        unmasked_hi = _clip(unmasked_hi - holds_tail * num_q_blocks, unmasked_lo, hi)
    else:
        unmasked_hi = _clip(unmasked_hi, unmasked_lo, hi)
    return lo, unmasked_lo, unmasked_hi, hi


def safe_exp_shift(row_max):
    """A row whose running max is still -inf saw no key yet: shift by 0 so exp2 gives 0, not NaN."""
    return jnp.where(row_max == -jnp.inf, 0.0, row_max)
