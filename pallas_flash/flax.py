"""An `attention_fn` for Flax: `linen.MultiHeadDotProductAttention(attention_fn=attention_fn)` and
`nnx.MultiHeadAttention(attention_fn=attention_fn)` run `flash_attention` instead of dense attention.

The adapter takes every argument those modules pass and honours each one. Causal attention, masks, bias,
attention dropout, MHA/GQA and float32/bfloat16/float16 go to `flash_attention` (a key-padding mask as segment
ids, any other mask and the bias read tile by tile); what the kernels cannot serve (sowing the weights for
`module`, custom einsums, other dtypes or head sizes) is computed exactly by a dense float32 path, logged once
per argument. `_dense_reasons` is the single place that decides.

Dropout differs from Flax's in its bits, not its distribution: Flax draws the keep mask with
`jax.random.bernoulli(dropout_rng, ...)`, which would need the [batch, heads, q_len, kv_len] mask in memory; the
kernels regenerate theirs tile by tile from a counter-based hash of (dropout_rng, batch, head, query, key)
(`pallas_flash.masks.dropout_keep_mask`). Each weight is kept with the same probability 1 - dropout_rate and
scaled by 1 / (1 - dropout_rate), and `broadcast_dropout` shares one mask across batch and heads as in Flax.
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


def make_attention_fn(
    *,
    is_causal: bool = False,
    implementation: str | None = None,
    config=None,
    deterministic_gradients: bool = True,
    score_mod=None,
    mask_mod=None,
):
    """An `attention_fn` for Flax's attention modules, with structure the caller knows up front.

    Args:
      is_causal: the attention is causal (query i sees key j <= i). The kernels apply it without an
        N x N mask, and a `mask` the module passes is taken to be that causal mask (as built by
        `flax.linen.make_causal_mask`) and is not read, so under `jit` it is never built. Combine causality
        with other masking (padding) by leaving this False and passing the combined mask.
      implementation, config: passed to `flash_attention`.
      deterministic_gradients: passed to `flash_attention` as `deterministic` (bitwise reproducible
        gradients; False lets the Hopper backward add dQ in a free order where that is faster). Named apart from
        Flax's own `deterministic`, the dropout switch.
      score_mod, mask_mod: passed to `flash_attention` on every call (`pallas_flash.mods` has the common ones,
        e.g. `mods.soft_cap(30.0)` or `mods.alibi(slopes)`); they apply over each call's folded batch.
    Returns:
      `attention_fn(query, key, value, bias=None, mask=None, ...)` with the signature of Flax's
      `dot_product_attention`; see `attention_fn`.
    """
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if not isinstance(deterministic_gradients, bool):
        raise TypeError(f"deterministic_gradients must be a bool, got {deterministic_gradients!r}")
    mask_is_causal = is_causal

    def attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        force_fp32_for_softmax=False,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
        is_causal=False,
    ):
        """Exact attention with the signature and semantics of Flax's `dot_product_attention`.

        Args:
          query: [batch..., q_len, heads, head_dim] (any number of leading batch dims, including none).
          key: [batch..., kv_len, kv_heads, head_dim], heads % kv_heads == 0; value: [batch..., kv_len,
            kv_heads, head_dim_v] (its own head_dim, as in MLA, or the same).
          bias, mask: broadcastable to [batch..., heads, q_len, kv_len]; a key is hidden where mask is
            False (or 0). A query whose keys are all masked gets the mean of the values, as in Flax.
          broadcast_dropout, dropout_rng, dropout_rate, deterministic: attention dropout with Flax's
            distribution, but not its bits (see the module docstring). A query that sees no key gets the
            mean of the values without dropout (Flax would drop some of its uniform weights).
          dtype: computation and output dtype; default the promoted dtype of query, key and value.
          precision: every path multiplies float32 at full precision with float32 accumulation, at least
            the precision any setting asks for.
          module: sow the attention weights [batch..., heads, q_len, kv_len] into it as Flax does.
          force_fp32_for_softmax: every path takes the softmax in float32.
          qk_attn_weights_einsum, attn_weights_value_einsum: custom einsums (linen, e.g. quantised);
            run by Flax's own dense attention.
          is_causal: query i sees key j <= i (passed by `nnx.MultiHeadAttention`); combined with `mask`.
        Returns:
          [batch..., q_len, heads, head_dim_v] in `dtype`.
        """
        if mask_is_causal and mask is not None:
            _log_once(
                "mask:causal",
                "`mask` is taken to be the causal mask that "
                "make_attention_fn(is_causal=True) declared, and is not read",
                logging.INFO,
            )
            mask = None
        causal = is_causal or mask_is_causal
        dropout = not deterministic and dropout_rate > 0.0
        if dropout and dropout_rng is None:
            raise ValueError(
                "dropout_rng is None, but attention dropout is active "
                f"(dropout_rate={dropout_rate}, deterministic={deterministic})"
            )
        if not query.ndim == key.ndim == value.ndim >= 3:
            raise ValueError(
                "query, key and value must be [batch..., seq, heads, head_dim] with the same "
                f"batch dims, got shapes {query.shape}, {key.shape} and {value.shape}"
            )
        dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))

        reasons = _dense_reasons(
            query, key, value, module=module, einsums=(qk_attn_weights_einsum, attn_weights_value_einsum)
        )
        programs = {name: fn for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)) if fn is not None}
        if reasons and programs:
            raise ValueError(
                f"make_attention_fn({', '.join(programs)}=...) needs the flash path, but this call must run densely: "
                + "; ".join(why for _, why in reasons)
            )
        if not reasons:
            dropout_args = (
                dict(
                    dropout_rate=float(dropout_rate), dropout_rng=dropout_rng, broadcast_dropout=bool(broadcast_dropout)
                )
                if dropout
                else {}
            )
            return _flash(
                query,
                key,
                value,
                mask=mask,
                bias=bias,
                is_causal=causal,
                implementation=implementation,
                config=config,
                deterministic=deterministic_gradients,
                **dropout_args,
                **programs,
            )
        for argument, why in reasons:
            _log_once(argument, f"{why}; computing this attention densely (memory grows as q_len * kv_len)")
        if causal:
            mask = _causal_and(mask, query.shape[-3], key.shape[-3])
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            return linen.dot_product_attention(
                query,
                key,
                value,
                bias,
                mask,
                broadcast_dropout,
                dropout_rng,
                dropout_rate,
                deterministic,
                dtype,
                precision,
                module,
                force_fp32_for_softmax,
                qk_attn_weights_einsum=qk_attn_weights_einsum,
                attn_weights_value_einsum=attn_weights_value_einsum,
            )
        return _dense(
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            dropout_rate=dropout_rate if dropout else 0.0,
            dropout_rng=dropout_rng,
            broadcast_dropout=broadcast_dropout,
            module=module,
        )

    return attention_fn


attention_fn = make_attention_fn()


def _dense_reasons(query, key, value, *, module, einsums):
    """(argument, why) for each argument the kernels cannot serve; empty when `flash_attention` is exact."""
    reasons = []
    if module is not None:
        reasons.append(("module", "`module` asks for the attention weights to be sown, which flash never forms"))
    if any(e is not None for e in einsums):
        reasons.append(("einsum", "custom `qk_attn_weights_einsum`/`attn_weights_value_einsum` replace the matmuls"))
    if not any(query.dtype == d for d in SUPPORTED_DTYPES):
        reasons.append(("dtype", f"dtype {query.dtype} is not served by the flash kernels"))
    if not all(MIN_HEAD_DIM <= x.shape[-1] <= MAX_HEAD_DIM for x in (query, value)):
        reasons.append(
            (
                "head_dim",
                f"head_dim {query.shape[-1]} (value {value.shape[-1]}) is outside the "
                f"kernels' {MIN_HEAD_DIM}..{MAX_HEAD_DIM}",
            )
        )
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


def _fold(x, batch_dims):
    """An array broadcastable to [batch..., heads, q_len, kv_len] as rank 4 [B | 1, ...]: the leading batch
    dims fold into one, kept at size 1 when x does not span them (a mask or bias shared by the batch stays
    unbroadcast; one that spans only some batch dims is broadcast over the rest)."""
    x = x.reshape((1,) * (len(batch_dims) + 3 - x.ndim) + x.shape)
    x_batch = x.shape[: len(batch_dims)]
    if any(n != 1 for n in x_batch) and x_batch != batch_dims:
        x = jnp.broadcast_to(x, batch_dims + x.shape[len(batch_dims) :])
    return x.reshape((math.prod(x.shape[: len(batch_dims)]),) + x.shape[len(batch_dims) :])


def _flash(
    query, key, value, *, mask, bias, is_causal, implementation, config, deterministic=True, score_mod=None,
    mask_mod=None, **dropout
):  # fmt: skip
    """`flash_attention` over any number of leading batch dims, folded into one. A key-padding mask becomes
    kv segment ids (query id 0; hidden keys 1); any other mask and the bias are passed as they are."""
    batch_dims = query.shape[:-3]
    batch = math.prod(batch_dims)
    fold = lambda x: x.reshape((batch,) + x.shape[len(batch_dims) :])
    key_mask = _key_padding(mask, query, key)
    kwargs = dict(dropout)
    if bias is not None:
        kwargs["bias"] = _fold(jnp.asarray(bias), batch_dims)
    if key_mask is not None:
        key_mask = fold(key_mask)
        kwargs.update(
            segment_ids=jnp.zeros((batch, query.shape[-3]), jnp.int32),
            kv_segment_ids=jnp.where(key_mask, 0, 1).astype(jnp.int32),
        )
        visible = key_mask[:, None, None, :]  # [batch, 1, 1, kv_len]
    elif mask is not None:
        visible = kwargs["mask"] = _fold(jnp.asarray(mask).astype(bool), batch_dims)
    out = flash_attention(
        fold(query),
        fold(key),
        fold(value),
        is_causal=is_causal,
        implementation=implementation,
        config=config,
        deterministic=deterministic,
        score_mod=score_mod,
        mask_mod=mask_mod,
        **kwargs,
    )
    if mask is not None:
        # Flax replaces hidden logits by the lowest float, so a query that sees no key attends uniformly to
        # all keys; the kernels give such a row zeros. Restore Flax's value for those rows, from the mask
        # alone (no pass over q_len * kv_len logits).
        q_pos = jnp.arange(query.shape[-3])
        first_visible = jnp.argmax(visible, axis=-1)  # [B|1, H|1, Tq|1]; 0 when none is visible, guarded below
        sees_none = ~jnp.any(visible, axis=-1)
        if is_causal:
            sees_none = sees_none | (first_visible > q_pos)
        sees_none = jnp.broadcast_to(sees_none, (batch, query.shape[-2], query.shape[-3])).transpose(0, 2, 1)
        heads, kv_heads = query.shape[-2], key.shape[-2]
        uniform = jnp.repeat(jnp.mean(fold(value).astype(jnp.float32), axis=1), heads // kv_heads, axis=1)
        out = jnp.where(sees_none[..., None], uniform[:, None].astype(out.dtype), out)
    return out.reshape(query.shape[:-1] + value.shape[-1:])


def _causal_and(mask, q_len, kv_len):
    causal = jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :]
    return causal if mask is None else jnp.logical_and(mask.astype(bool), causal)


def _dense(query, key, value, *, bias, mask, dropout_rate, dropout_rng, broadcast_dropout, module):
    """Dense attention in float32 with Flax's semantics: the exact fallback.

    query [batch..., q_len, heads, head_dim], key [batch..., kv_len, kv_heads, head_dim], value [batch...,
    kv_len, kv_heads, head_dim_v].
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
