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
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
    def of(cls, is_causal: bool, local_window_size=None) -> Band:
        left, right = (None, None) if local_window_size is None else local_window_size
        if is_causal:
            right = 0 if right is None else min(right, 0)
        return cls(left, right)

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None

    @property
    def is_causal(self) -> bool:
        """Exactly causal: every key up to the query's position (a window is not)."""
        return self.left is None and self.right == 0

    @property
    def keys_before_queries(self) -> bool:
        """Every key the band lets a query see is at or before it (right edge <= 0): there |k - q| = q - k."""
        return self.right is not None and self.right <= 0

    def __and__(self, other: Band) -> Band:
        """The keys both bands let a query see."""
        tighter = lambda a, b: b if a is None else a if b is None else min(a, b)
        return Band(tighter(self.left, other.left), tighter(self.right, other.right))


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


def pad_segment_ids(q_ids, kv_ids, q_pad: int, kv_pad: int):
    """int32 segment ids padded to the kernels' lengths with the padding ids (which match nothing), or
    (None, None) without ids."""
    if q_ids is None:
        return None, None

    def pad(ids, size, value):
        ids = ids.astype(jnp.int32)
        return ids if ids.shape[1] == size else jnp.pad(ids, ((0, 0), (0, size - ids.shape[1])), constant_values=value)

    return pad(q_ids, q_pad, QUERY_PADDING_ID), pad(kv_ids, kv_pad, KEY_PADDING_ID)


def integer_cotangent(x):
    """The cotangent of an integer input of a custom_vjp (segment ids, masks, seeds): float0 zeros, or None."""
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def segments_from_lengths(segment_ids, lengths, length: int, padding_id: int):
    """Fold per-example lengths [batch] into segment ids [batch, length]: positions past an example's
    length get `padding_id`. Returns None when there are neither ids nor lengths."""
    if lengths is None:
        return segment_ids
    valid = jnp.arange(length)[None, :] < lengths[:, None]
    ids = jnp.zeros((lengths.shape[0], length), jnp.int32) if segment_ids is None else segment_ids
    return jnp.where(valid, ids, padding_id)


# ---- Score modifiers: bias, boolean mask, ALiBi, logit soft-capping and dropout ----------------------------
#
# Every implementation computes, per (batch, head, query i, key j):
#   x      = scale * q_i . k_j
#   x      = soft_cap * tanh(x / soft_cap)                 (if logits_soft_cap; before bias and ALiBi)
#   logit  = x + bias[b, h, i, j] - slope[b, h] * |j - i|  (bias, ALiBi)
#   hidden where mask[b, h, i, j] is False or `visible` is False (logit -inf)
#   p      = softmax_j(logit);  lse = logsumexp_j(logit)   (the LSE of the un-dropped softmax)
#   out_i  = sum_j p_ij * keep_ij / (1 - rate) * v_j       (dropout)
# The helpers below are that definition; the reference, the XLA chunked path and the kernels call them on
# whatever tile of positions they hold.


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """The static half of a call's score modifiers (their arrays travel as `ModArrays`).

    bias_dims / mask_dims: which of [batch, heads, q_len, kv_len] the bias / mask spans (False: size 1,
      broadcast), or None without one. alibi: slopes given. soft_cap: logits_soft_cap or None.
    dropout_rate: in [0, 1). broadcast_dropout: one keep mask shared by every batch element and head.
    score_mod / mask_mod: traced `mods.Program`s or None (their closed-over arrays travel in `ModArrays`).
    bias_dtype: the bias's dtype name (None without one): dispatch sizes the kernels' bias tiles by it.
    """

    bias_dims: tuple | None = None
    mask_dims: tuple | None = None
    alibi: bool = False
    soft_cap: float | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    score_mod: typing.Any = None  # a mods.Program of kind "score", applied after bias and ALiBi
    mask_mod: typing.Any = None  # a mods.Program of kind "mask", ANDed with the other masks
    bias_dtype: str | None = None

    @property
    def active(self) -> bool:
        return self != ScoreMods()


class ModArrays(typing.NamedTuple):
    """The arrays of the score modifiers, None where absent. bias: float [Bb, Hb, Tqb, Tkb] and mask:
    bool [Bm, Hm, Tqm, Tkm], each dim 1 or full; alibi_slopes: float32 [batch, heads]; dropout_seed:
    uint32 [2]."""

    bias: typing.Any = None
    mask: typing.Any = None
    alibi_slopes: typing.Any = None
    dropout_seed: typing.Any = None
    score_consts: tuple = ()  # the arrays the score_mod closes over
    mask_consts: tuple = ()  # the arrays the mask_mod closes over

    def cotangents(self, dbias=None, d_score_consts=None) -> ModArrays:
        """The cotangent of these arrays in a custom_vjp: `dbias` for the bias, `d_score_consts` for the
        score_mod's arrays, float0 for the mask and seed (not differentiable), zeros for the ALiBi slopes
        (constants: the API stops their gradient) and for the mask_mod's arrays (a bool result has no gradient)."""
        slopes = None if self.alibi_slopes is None else jnp.zeros_like(self.alibi_slopes)
        if d_score_consts is None:
            d_score_consts = tuple(zero_cotangent(c) for c in self.score_consts)
        return ModArrays(
            dbias,
            integer_cotangent(self.mask),
            slopes,
            integer_cotangent(self.dropout_seed),
            tuple(d_score_consts),
            tuple(zero_cotangent(c) for c in self.mask_consts),
        )


def zero_cotangent(x):
    """A cotangent of zeros for x: float zeros, or float0 for integer and bool arrays."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return integer_cotangent(x)


def soft_cap(x, cap: float):
    return cap * jnp.tanh(x / cap)


def soft_cap_grad(capped, cap: float):
    """d capped / d x, from the capped value: 1 - tanh^2."""
    t = capped / cap
    return 1.0 - t * t


def alibi(slope, q_pos, k_pos):
    """ALiBi's additive bias -slope * |j - i| (FlashAttention-2's convention; with is_causal it is
    slope * (j - i) on every visible key). Positions count from each sequence's start (top-left)."""
    return -slope * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def add_biases(x, *, q_pos, k_pos, bias=None, slope=None):
    """(Soft-capped) scaled logits -> the softmax's logits: + bias, + ALiBi (where given). The mask is
    applied by the caller, with the visibility mask."""
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    if slope is not None:
        x = x + alibi(slope, q_pos, k_pos)
    return x


# Dropout keep mask: a counter-based hash of (seed, batch, head, query, key), so any implementation with any
# tiling regenerates the same bits (and the backward regenerates the forward's). Mixing is murmur3's 32-bit
# finalizer (fmix32); each coordinate enters through an odd multiplier, so distinct inputs do not collide
# trivially. Only uint32 multiplies (which wrap), xors and logical shifts: the same ops lower on Triton.
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
_BATCH_MUL, _HEAD_MUL, _QUERY_MUL, _KEY_MUL = 0x9E3779B1, 0x7FEB352D, 0x846CA68B, 0xCC9E2D51
_KEEP_BITS = 24  # the keep test compares the hash's top 24 bits, as non-negative int32


def _u32(x):
    if isinstance(x, int):  # constants above 2^31 would not fit JAX's default int32
        return np.uint32(x)
    return jnp.asarray(x).astype(jnp.uint32)


def _fmix32(h):
    h = h ^ lax.shift_right_logical(h, _u32(16))
    h = h * _u32(_FMIX1)
    h = h ^ lax.shift_right_logical(h, _u32(13))
    h = h * _u32(_FMIX2)
    return h ^ lax.shift_right_logical(h, _u32(16))


def dropout_row_hash(seed0, seed1, batch, head, q_pos):
    """The hash state after (seed, batch, head, query): computed once per row, then mixed with each key."""
    h = _fmix32(_u32(seed0) ^ (_u32(batch) * _u32(_BATCH_MUL)))
    h = _fmix32(h ^ _u32(seed1) ^ (_u32(head) * _u32(_HEAD_MUL)))
    return _fmix32(h ^ (_u32(q_pos) * _u32(_QUERY_MUL)))


def dropout_keep_threshold(rate: float) -> int:
    return min(int(round(rate * (1 << _KEEP_BITS))), (1 << _KEEP_BITS) - 1)


def dropout_keep(row_hash, k_pos, rate: float):
    """Keep (True) with probability 1 - rate (to 2^-24), from a row's hash and key positions."""
    bits = _fmix32(row_hash ^ (_u32(k_pos) * _u32(_KEY_MUL)))
    top = lax.shift_right_logical(bits, _u32(32 - _KEEP_BITS)).astype(jnp.int32)
    return top >= dropout_keep_threshold(rate)


def dropout_keep_mask(seed, batch, head, q_pos, k_pos, rate: float):
    """The dropout keep mask in plain JAX: bool, the broadcast shape of the integer index arrays `batch`,
    `head` (query head), `q_pos`, `k_pos`. `seed` is uint32 [2] (`dropout_seed`). With broadcast_dropout
    the implementations pass batch = head = 0."""
    return dropout_keep(dropout_row_hash(seed[0], seed[1], batch, head, q_pos), k_pos, rate)


def dropout_seed(rng):
    """uint32 [2] seed of the keep mask from a JAX PRNG key (typed, or raw uint32 [2] key data)."""
    return jax.random.bits(rng, (2,), jnp.uint32)
