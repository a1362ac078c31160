"""Which keys a query may see: one definition shared by every implementation.

Every implementation (the dense reference, the XLA chunked path and the Pallas kernels) asks the same
function which (query, key) pairs are visible, on whatever tile of positions it holds, so the semantics
cannot drift between them.
"""
from __future__ import annotations

import jax.numpy as jnp


def visible(q_pos, k_pos, *, is_causal: bool, kv_len: int | None = None):
    """Boolean visibility of keys `k_pos` to queries `q_pos` (broadcasting integer arrays).

    `is_causal` follows `jax.nn.dot_product_attention`: query i sees key j iff j <= i (aligned at the top
    left, also when q_len != kv_len). `kv_len` hides key positions >= kv_len (padding of a ragged tail).
    Returns None when every pair is visible, so callers can skip the select entirely.
    """
    mask = None
    if is_causal:
        mask = k_pos <= q_pos
    if kv_len is not None:
        in_range = k_pos < kv_len
        mask = in_range if mask is None else jnp.logical_and(mask, in_range)
    return mask
