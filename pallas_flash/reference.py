"""Dense attention in float32: the oracle every implementation is tested against.

It materialises the [batch, heads, q_len, kv_len] logits, so its memory grows as N^2; it is also the
`implementation="xla"` path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash import block_sparse, masks


def attention_reference(
    query,
    key,
    value,
    *,
    scale: float,
    is_causal: bool = False,
    band=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_mask=None,
    bias=None,
    mask=None,
    alibi_slopes=None,
    logits_soft_cap=None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    broadcast_dropout: bool = False,
    score_mod=None,
    score_consts=(),
    mask_mod=None,
    mask_consts=(),
    sinks=None,
):
    """Exact attention, computed densely in float32.

    Args:
      query: [batch, q_len, heads, head_dim].
      key: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0 (query head h reads kv head
        h // (heads // kv_heads), as in `jax.nn.dot_product_attention`).
      value: [batch, kv_len, kv_heads, head_dim_v] (head_dim_v may differ from head_dim).
      is_causal / band: the visible band (`masks.Band`); `band` overrides `is_causal` when given.
      q_segment_ids, kv_segment_ids: optional int32 [batch, q_len] / [batch, kv_len]; a query sees only
        keys of its own segment.
      block_mask: optional `BlockMask`; query i sees key j only where its block is True.
      bias, mask: float / bool arrays broadcastable to [batch, heads, q_len, kv_len] (mask True = attend).
      alibi_slopes: float [heads] or [batch, heads]. logits_soft_cap: float or None.
      dropout_rate, dropout_seed (uint32 [2], `masks.dropout_seed`), broadcast_dropout: attention dropout
        with `masks.dropout_keep_mask`. The order of all of these is defined in `masks` (score modifiers).
      score_mod, mask_mod: traced `mods.Program`s (or None) with their closed-over arrays `score_consts`,
        `mask_consts`: the score_mod after bias and ALiBi, the mask_mod ANDed with the other masks.
      sinks: float [heads] or None: a logit per head that joins every row's softmax denominator and attends
        to nothing (gpt-oss's attention sinks).
    Returns:
      (out [batch, q_len, heads, head_dim_v] in query's dtype, lse [batch, heads, q_len] float32, natural log).
      A query that sees no key gets out = 0 and lse = -inf.
    """
    batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    group = heads // kv_heads
    band = masks.Band.of(is_causal) if band is None else band
    q = query.astype(jnp.float32).reshape(batch, q_len, kv_heads, group, head_dim)
    k = key.astype(jnp.float32)
    v = value.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=hp) * scale
    q_pos, k_pos = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    slope = None
    if alibi_slopes is not None:  # [heads] or [batch, heads] -> [batch, heads, 1, 1]
        slope = jnp.broadcast_to(alibi_slopes.astype(jnp.float32), (batch, heads))[:, :, None, None]
    if logits_soft_cap is not None:
        logits = masks.soft_cap(logits, logits_soft_cap)
    logits = masks.add_biases(
        logits.reshape(batch, heads, q_len, kv_len), q_pos=q_pos, k_pos=k_pos, bias=bias, slope=slope
    )
    b_idx, h_idx = jnp.arange(batch)[:, None, None, None], jnp.arange(heads)[None, :, None, None]
    if score_mod is not None:
        logits = score_mod.apply(score_consts, logits, b_idx, h_idx, q_pos, k_pos)
    logits = logits.reshape(batch, kv_heads, group, q_len, kv_len)
    segments = {}
    if q_segment_ids is not None:  # [batch, 1, 1, q_len, 1] against [batch, 1, 1, 1, kv_len]
        segments = dict(
            q_segment=q_segment_ids[:, None, None, :, None], kv_segment=kv_segment_ids[:, None, None, None, :]
        )
    seen = masks.visible(q_pos, k_pos, band=band, **segments)
    if block_mask is not None:
        block_mask.check(batch, heads, q_len, kv_len)
        tokens = block_sparse.grouped(jnp.asarray(block_mask.expand(q_len, kv_len)), kv_heads)
        seen = block_sparse.combine(seen, tokens)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (batch, heads, q_len, kv_len)).reshape(logits.shape)
        seen = mask if seen is None else jnp.logical_and(seen, mask)
    if mask_mod is not None:
        mask = mask_mod.apply(mask_consts, b_idx, h_idx, q_pos, k_pos)
        mask = jnp.broadcast_to(mask, (batch, heads, q_len, kv_len)).reshape(logits.shape)
        seen = mask if seen is None else jnp.logical_and(seen, mask)
    if seen is not None:
        logits = jnp.where(seen, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:  # [heads] -> [batch, kv_heads, group, q_len, 1]
        sink = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1, 1), (batch, kv_heads, group, q_len, 1)
        )
        row_max = jnp.maximum(row_max, sink)
    # A fully masked row has max -inf; shifting by 0 instead keeps exp() at exactly 0 rather than NaN.
    row_max = jnp.where(jnp.isneginf(row_max), 0.0, jax.lax.stop_gradient(row_max))
    weights = jnp.exp(logits - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    probs = weights / jnp.where(denom == 0.0, 1.0, denom)
    if dropout_rate > 0.0:
        b, h = (
            (0, 0)
            if broadcast_dropout
            else (jnp.arange(batch)[:, None, None, None], jnp.arange(heads)[None, :, None, None])
        )
        keep = masks.dropout_keep_mask(dropout_seed, b, h, q_pos, k_pos, dropout_rate)
        keep = jnp.broadcast_to(keep, (batch, heads, q_len, kv_len)).reshape(probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, precision=hp)
    # log(0) = -inf for fully masked rows, taken through a safe log so the gradient stays finite.
    lse = jnp.where(denom == 0.0, -jnp.inf, jnp.log(jnp.where(denom == 0.0, 1.0, denom)) + row_max)[..., 0]
    out = out.reshape(batch, q_len, heads, v.shape[-1]).astype(query.dtype)
    return out, lse.reshape(batch, heads, q_len)
