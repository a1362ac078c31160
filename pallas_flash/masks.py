"""Which keys a query may see: one definition shared by every implementation.

Visibility is the conjunction of
  * a band: query i sees key j iff i - left <= j <= i + right. Causal attention is right = 0 (with
    `jax.nn.dot_product_attention`'s top-left alignment, also when q_len != kv_len); a local window
    (left, right) bounds both sides; None means unbounded;
  * segment ids: a query sees only keys with its own segment id (packed sequences). Per-example
    lengths become segment ids too (padding positions get ids that match nothing);
  * the padded tail: key positions >= kv_len (the kernels pad lengths to block multiples).
The dense reference, the XLA chunked path and the Pallas kernels all call `visible` on whatever tile of
positions they hold, so the semantics cannot drift between them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Segment ids given to padding positions; they never equal each other. The two most negative int32
# values are reserved for them (documented in `flash_attention`).
QUERY_PADDING_ID = -(2**31)
KEY_PADDING_ID = -(2**31) + 1


@dataclasses.dataclass(frozen=True)
class Band:
    """Keys at most `left` positions before and `right` positions after the query (None: unbounded)."""

    left: int | None = None
    right: int | None = None

    @classmethod
    def of(cls, is_causal: bool, local_window_size=None) -> "Band":
        left, right = (None, None) if local_window_size is None else local_window_size
        if is_causal:
            right = 0 if right is None else min(right, 0)
        return cls(left, right)

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None


def visible(q_pos, k_pos, *, band: Band, kv_len: int | None = None, q_segment=None, kv_segment=None):
    """Boolean visibility of keys `k_pos` to queries `q_pos` (broadcasting integer arrays); segment ids
    broadcast the same way. Returns None when every pair is visible, so callers can skip the select."""
    conditions = []
    if band.right is not None:
        conditions.append(k_pos <= q_pos + band.right)
    if band.left is not None:
        conditions.append(k_pos >= q_pos - band.left)
    if kv_len is not None:
        conditions.append(k_pos < kv_len)
    if q_segment is not None:
        conditions.append(q_segment == kv_segment)
    if not conditions:
        return None
    mask = conditions[0]
    for condition in conditions[1:]:
        mask = jnp.logical_and(mask, condition)
    return mask


def segments_from_lengths(segment_ids, lengths, length: int, padding_id: int):
    """Fold per-example lengths [batch] into segment ids [batch, length]: positions past an example's
    length get `padding_id`. Returns None when there are neither ids nor lengths."""
    if lengths is None:
        return segment_ids
    valid = jnp.arange(length)[None, :] < lengths[:, None]
    ids = jnp.zeros((lengths.shape[0], length), jnp.int32) if segment_ids is None else segment_ids
    return jnp.where(valid, ids, padding_id)
