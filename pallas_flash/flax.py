"""An `attention_fn` for Flax: `linen.MultiHeadDotProductAttention(attention_fn=attention_fn)` and
`nnx.MultiHeadAttention(attention_fn=attention_fn)` run `flash_attention` instead of dense attention.

The adapter takes every argument those modules pass and honours each one. What the kernels serve today
(causal, a key-padding mask, MHA/GQA, float32/bfloat16/float16) goes to `flash_attention`; anything else (a
general `mask` or `bias`, attention dropout, sowing the weights for `module`, custom einsums) is computed exactly by
a dense float32 path, logged once per argument. `_dense_reasons` is the single place that decides.
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from flax import linen, nnx

from pallas_flash.api import MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES, flash_attention

logger = logging.getLogger("pallas_flash")

_logged: set = set()


def _log_once(argument: str, message: str, level: int = logging.WARNING) -> None:
    if argument not in _logged:
        _logged.add(argument)
        logger.log(level, "pallas_flash.flax: %s", message)


def make_attention_fn(*, is_causal: bool = False, implementation: str | None = None, config=None):
    """An `attention_fn` for Flax's attention modules, with structure the caller knows up front.

    Args:
      is_causal: the attention is causal (query i sees key j <= i). The kernels apply it without an
        N x N mask, and a `mask` the module passes is taken to be that causal mask (as built by
        `flax.linen.make_causal_mask`) and is not read, so under `jit` it is never built. Combine causality
        with other masking (padding) by leaving this False and passing the combined mask.
      implementation, config: passed to `flash_attention`.
    Returns:
      `attention_fn(query, key, value, bias=None, mask=None, ...)` with the signature of Flax's
      `dot_product_attention`; see `attention_fn`.
    """
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    mask_is_causal = is_causal

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                     dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                     force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                     attn_weights_value_einsum=None, is_causal=False):
        """Exact attention with the signature and semantics of Flax's `dot_product_attention`.

        Args:
          query: [batch..., q_len, heads, head_dim] (any number of leading batch dims, including none).
          key, value: [batch..., kv_len, kv_heads, head_dim], heads % kv_heads == 0.
          bias, mask: broadcastable to [batch..., heads, q_len, kv_len]; a key is hidden where mask is
            False (or 0). A query whose keys are all masked gets the mean of the values, as in Flax.
          broadcast_dropout, dropout_rng, dropout_rate, deterministic: attention dropout, drawn exactly
            as Flax draws it (same key, same shape, same keep mask).
          dtype: computation and output dtype; default the promoted dtype of query, key and value.
          precision: every path multiplies float32 at full precision with float32 accumulation, at least
            the precision any setting asks for.
          module: sow the attention weights [batch..., heads, q_len, kv_len] into it as Flax does.
          force_fp32_for_softmax: every path takes the softmax in float32.
          qk_attn_weights_einsum, attn_weights_value_einsum: custom einsums (linen, e.g. quantised);
            run by Flax's own dense attention.
          is_causal: query i sees key j <= i (passed by `nnx.MultiHeadAttention`); combined with `mask`.
        Returns:
          [batch..., q_len, heads, head_dim] in `dtype`.
        """
        if mask_is_causal and mask is not None:
            _log_once("mask:causal", "`mask` is taken to be the causal mask that "
                      "make_attention_fn(is_causal=True) declared, and is not read", logging.INFO)
            mask = None
        causal = is_causal or mask_is_causal
        dropout = not deterministic and dropout_rate > 0.0
        if dropout and dropout_rng is None:
            raise ValueError("dropout_rng is None, but attention dropout is active "
                             f"(dropout_rate={dropout_rate}, deterministic={deterministic})")
        if not query.ndim == key.ndim == value.ndim >= 3:
            raise ValueError("query, key and value must be [batch..., seq, heads, head_dim] with the same "
                             f"batch dims, got shapes {query.shape}, {key.shape} and {value.shape}")
        dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))

        key_mask = _key_padding(mask, query, key)
        reasons = _dense_reasons(query, key, value, bias=bias, mask=None if key_mask is not None else mask,
                                 dropout=dropout, module=module,
                                 einsums=(qk_attn_weights_einsum, attn_weights_value_einsum))
        if not reasons:
            return _flash(query, key, value, key_mask=key_mask, is_causal=causal, implementation=implementation,
                          config=config)
        for argument, why in reasons:
            _log_once(argument, f"{why}; computing this attention densely (memory grows as q_len * kv_len)")
        if causal:
            mask = _causal_and(mask, query.shape[-3], key.shape[-3])
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            return linen.dot_product_attention(
                query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
                dtype, precision, module, force_fp32_for_softmax,
                qk_attn_weights_einsum=qk_attn_weights_einsum,
                attn_weights_value_einsum=attn_weights_value_einsum)
        return _dense(query, key, value, bias=bias, mask=mask,
                      dropout_rate=dropout_rate if dropout else 0.0, dropout_rng=dropout_rng,
                      broadcast_dropout=broadcast_dropout, module=module)

    return attention_fn


attention_fn = make_attention_fn()


def _dense_reasons(query, key, value, *, bias, mask, dropout, module, einsums):
    """(argument, why) for each argument the kernels cannot serve yet; empty when `flash_attention` is exact.

    A key-padding mask ([batch..., 1, 1, kv_len]) never reaches this list: the kernels take it as segment
    ids. TODO(masks-and-dropout issue): pass general `mask`s, `bias` and dropout to the kernels too.
    """
    reasons = []
    if mask is not None:
        reasons.append(("mask", "a dense `mask` is not served by the flash kernels yet"))
    if bias is not None:
        reasons.append(("bias", "`bias` is not served by the flash kernels yet"))
    if dropout:
        reasons.append(("dropout_rate", "attention dropout (`dropout_rate` > 0, not `deterministic`) is not "
                                        "served by the flash kernels yet"))
    if module is not None:
        reasons.append(("module", "`module` asks for the attention weights to be sown, which flash never forms"))
    if any(e is not None for e in einsums):
        reasons.append(("einsum", "custom `qk_attn_weights_einsum`/`attn_weights_value_einsum` replace the "
                                  "matmuls"))
    if not any(query.dtype == d for d in SUPPORTED_DTYPES):
        reasons.append(("dtype", f"dtype {query.dtype} is not served by the flash kernels"))
    if not (MIN_HEAD_DIM <= query.shape[-1] <= MAX_HEAD_DIM) or value.shape[-1] != query.shape[-1]:
        reasons.append(("head_dim", f"head_dim {query.shape[-1]} (value {value.shape[-1]}) is outside the "
                                    f"kernels' {MIN_HEAD_DIM}..{MAX_HEAD_DIM} or differs between query and value"))
    return reasons


def _key_padding(mask, query, key):
    """A mask that hides keys only ([batch..., 1, 1, kv_len], as an encoder builds it) as a boolean
    [batch..., kv_len] array the kernels take as segment ids; None for any other mask."""
    if mask is None or mask.ndim != query.ndim or mask.shape[-3:-1] != (1, 1):
        return None
    if mask.shape[-1] != key.shape[-3]:
        return None
    batch_dims = query.shape[:-3]
    try:
        return jnp.broadcast_to(mask[..., 0, 0, :].astype(bool), batch_dims + (key.shape[-3],))
    except ValueError:
        return None


def _flash(query, key, value, *, key_mask, is_causal, implementation, config):
    """`flash_attention` over any number of leading batch dims, folded into one. A key-padding mask becomes
    kv segment ids (query id 0; hidden keys 1)."""
    batch_dims = query.shape[:-3]
    batch = math.prod(batch_dims)
    fold = lambda x: x.reshape((batch,) + x.shape[len(batch_dims):])
    segments = {}
    if key_mask is not None:
        key_mask = fold(key_mask)
        segments = dict(segment_ids=jnp.zeros((batch, query.shape[-3]), jnp.int32),
                        kv_segment_ids=jnp.where(key_mask, 0, 1).astype(jnp.int32))
    out = flash_attention(fold(query), fold(key), fold(value), is_causal=is_causal,
                          implementation=implementation, config=config, **segments)
    if key_mask is not None:
        # Flax replaces hidden logits by the lowest float, so a query that sees no key attends uniformly to
        # all keys; the kernels give such a row zeros. Restore Flax's value for those rows: O(N), exact.
        q_pos = jnp.arange(query.shape[-3])
        first_visible = jnp.argmax(key_mask, axis=-1)  # 0 when no key is visible; guarded below
        any_visible = jnp.any(key_mask, axis=-1)
        sees_none = ~any_visible[:, None]
        if is_causal:
            sees_none = sees_none | (first_visible[:, None] > q_pos[None, :])
        heads, kv_heads = query.shape[-2], key.shape[-2]
        uniform = jnp.repeat(jnp.mean(fold(value).astype(jnp.float32), axis=1), heads // kv_heads, axis=1)
        out = jnp.where(sees_none[:, :, None, None], uniform[:, None].astype(out.dtype), out)
    return out.reshape(query.shape)


def _causal_and(mask, q_len, kv_len):
    causal = jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :]
    return causal if mask is None else jnp.logical_and(mask.astype(bool), causal)


def _dense(query, key, value, *, bias, mask, dropout_rate, dropout_rng, broadcast_dropout, module):
    """Dense attention in float32 with Flax's semantics: the exact fallback.

    query [batch..., q_len, heads, head_dim], key/value [batch..., kv_len, kv_heads, head_dim].
    """
    *batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[-3], key.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"key has {kv_heads} heads; query's {heads} heads must be a multiple of it")
    hp = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    # Query head h reads kv head h // groups: split heads into [kv_heads, groups] rather than copy K and V.
    q = query.astype(f32).reshape(*batch, q_len, kv_heads, heads // kv_heads, head_dim)
    logits = jnp.einsum("...qhgd,...khd->...hgqk", q, key.astype(f32), precision=hp) / math.sqrt(head_dim)
    logits = logits.reshape(*batch, heads, q_len, kv_len)
    if bias is not None:
        logits = logits + bias.astype(f32)
    if mask is not None:
        # Replacing (not adding) the lowest float, as Flax does: a fully masked row softmaxes to uniform.
        logits = jnp.where(mask.astype(bool), logits, jnp.finfo(f32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if module is not None:
        if isinstance(module, linen.Module):
            module.sow("intermediates", "attention_weights", weights.astype(query.dtype))
        else:
            module.sow(nnx.Intermediate, "attention_weights", weights.astype(query.dtype))
    if dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        # The keep mask's key and shape are Flax's, so the same dropout_rng drops the same weights.
        shape = (1,) * len(batch) + (1,) + weights.shape[-2:] if broadcast_dropout else weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * keep.astype(f32) / keep_prob
    weights = weights.reshape(*batch, kv_heads, heads // kv_heads, q_len, kv_len)
    out = jnp.einsum("...hgqk,...khd->...qhgd", weights, value.astype(f32), precision=hp)
    return out.reshape(*batch, q_len, heads, value.shape[-1]).astype(query.dtype)
