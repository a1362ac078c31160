"""Tile-level helpers shared by the portable forward and backward kernels."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash import masks

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b on a tile with float32 accumulation; float32 operands use full IEEE precision (not tf32)."""
    contract_a = 0 if trans_a else 1
    contract_b = 1 if trans_b else 0
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def tile_mask(q_start, k_start, block_q: int, block_kv: int, *, is_causal: bool, kv_len: int | None,
              keys_major: bool = False):
    """Visibility of the tile whose first query/key positions are q_start/k_start: [block_q, block_kv],
    or [block_kv, block_q] with `keys_major` (the transposed tiles of the dK/dV kernel)."""
    shape, q_axis = ((block_kv, block_q), 1) if keys_major else ((block_q, block_kv), 0)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return masks.visible(q_pos, k_pos, is_causal=is_causal, kv_len=kv_len)


def kv_block_range(q_block, *, block_q: int, block_kv: int, num_kv_blocks: int, kv_len: int,
                   is_causal: bool):
    """Key blocks a query block must visit: (first masked block, end). Blocks before the first masked one
    are wholly visible and skip the mask; blocks from `end` on are wholly invisible and are never loaded."""
    full_tail = kv_len // block_kv  # blocks that hold no padded key
    if not is_causal:
        return min(full_tail, num_kv_blocks), num_kv_blocks
    first_row = q_block * block_q
    # Key block j is visible to every row iff its last key <= the first row.
    unmasked = jnp.minimum((first_row + 1) // block_kv, full_tail)
    end = jnp.minimum((first_row + block_q + block_kv - 1) // block_kv, num_kv_blocks)
    return jnp.minimum(unmasked, end), end


def q_block_range(kv_block, *, block_q: int, block_kv: int, num_q_blocks: int, is_causal: bool):
    """Query blocks that see a key block: (start, first wholly visible block). Blocks before `start`
    see none of it (skipped); blocks in [start, unmasked) need the causal mask."""
    if not is_causal:
        return 0, 0
    first_key = kv_block * block_kv
    start = jnp.minimum(first_key // block_q, num_q_blocks)
    # Query block i sees every key of the block iff its first row >= the block's last key.
    unmasked = jnp.minimum((first_key + block_kv - 1 + block_q - 1) // block_q, num_q_blocks)
    return start, unmasked


def safe_exp_shift(row_max):
    """A row whose running max is still -inf saw no key yet: shift by 0 so exp2 gives 0, not NaN."""
    return jnp.where(row_max == -jnp.inf, 0.0, row_max)


def launch_order(program, num_q_blocks: int, is_causal: bool):
    """Query block handled by a program. Causal query blocks near the end visit the most key blocks:
    launching them first keeps the longest programs from trailing behind in the last wave."""
    return num_q_blocks - 1 - program if is_causal else program
