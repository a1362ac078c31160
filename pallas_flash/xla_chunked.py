"""O(seq)-memory attention in plain JAX: `lax.scan` over key blocks with online softmax.

The default off NVIDIA GPUs (Pallas interpret mode is far too slow for real use). The forward keeps a
running (max, sum, output) per query row; the backward, a `custom_vjp`, rescans the key blocks and
recomputes the probabilities from the saved log-sum-exp, so neither pass holds more than a
[batch, heads, q_len, block_kv] slice of the logits. A bias or mask that spans kv_len is sliced into the
same key blocks (so it is never broadcast to [batch, heads, q_len, kv_len]); the dropout keep mask is
regenerated per block from `masks.dropout_keep_mask`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash import block_sparse, masks
from pallas_flash.blocks import LOG2E


def _einsum(spec, a, b):
    # float32 inputs get float32 products: XLA on GPU would otherwise round operands to tf32.
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _blocks(x, block_kv):
    """[batch, kv_len, kv_heads, dim] -> [num_blocks, batch, block_kv, kv_heads, dim], zero padded."""
    batch, kv_len, kv_heads, dim = x.shape
    num_blocks = -(-kv_len // block_kv)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * block_kv - kv_len), (0, 0), (0, 0)))
    return x.reshape(batch, num_blocks, block_kv, kv_heads, dim).swapaxes(0, 1)


def _segment_blocks(kv_segment_ids, block_kv):
    """[batch, kv_len] -> [num_blocks, batch, block_kv] (or None)."""
    if kv_segment_ids is None:
        return None
    return _blocks(kv_segment_ids[..., None, None], block_kv)[..., 0, 0]


def _last_axis_blocks(x, block_kv, num_blocks):
    """[..., kv_len] -> [num_blocks, ..., block_kv] (zero/False padded); None stays None."""
    if x is None:
        return None
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, num_blocks * block_kv - x.shape[-1])])
    return jnp.moveaxis(x.reshape(*x.shape[:-1], num_blocks, block_kv), -2, 0)


def _mod_blocks(mods, mod_arrays, kv_heads, block_kv, num_blocks):
    """The bias and mask as ([num_blocks, ...] scanned, or unblocked when they do not span kv_len)."""
    bias, mask = (None if x is None else block_sparse.grouped(x, kv_heads) for x in (mod_arrays.bias, mod_arrays.mask))
    spans = lambda dims: dims is not None and dims[3]
    return (
        (_last_axis_blocks(bias, block_kv, num_blocks) if spans(mods.bias_dims) else None),
        (_last_axis_blocks(mask, block_kv, num_blocks) if spans(mods.mask_dims) else None),
        bias,
        mask,
    )


def _block_logits2(
    q, k_blk, start, seg_blk, q_segment_ids, bias_blk, mask_blk, mod_arrays, *, scale, band, kv_len, mods, block_mask
):
    """Logits of one key block in the log2 domain, masked to -inf: [batch, kv_heads, group, q_len, block];
    d logits / d (scaled q.k) for a soft cap (else None); and the score_mod's vjp at this block (else None):
    (d logit) -> (d logit before the score_mod, d its closed-over arrays)."""
    batch, q_len, kv_heads, group, _ = q.shape
    q_pos = jnp.arange(q_len)[:, None]
    k_pos = start + jnp.arange(k_blk.shape[1])[None, :]
    b_idx = jnp.arange(batch)[:, None, None, None, None]
    h_idx = jnp.arange(kv_heads * group).reshape(1, kv_heads, group, 1, 1)
    x = _einsum("bqhgd,bkhd->bhgqk", q, k_blk)
    score_vjp = None
    if not mods.active:  # the plain path: one multiply
        s, grad_factor = x * (scale * LOG2E), None
    else:
        slope = None
        if mods.alibi:
            slope = mod_arrays.alibi_slopes.reshape(batch, kv_heads, group)[..., None, None]
        x = x * scale
        capped = masks.soft_cap(x, mods.soft_cap) if mods.soft_cap is not None else x
        grad_factor = masks.soft_cap_grad(capped, mods.soft_cap) if mods.soft_cap is not None else None
        s = masks.add_biases(capped, q_pos=q_pos, k_pos=k_pos, bias=bias_blk, slope=slope)
        if mods.score_mod is not None:
            consts = mod_arrays.score_consts
            floats = [i for i, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.inexact)]

            def score_mod(s, float_consts):
                merged = list(consts)
                for i, c in zip(floats, float_consts):
                    merged[i] = c
                return mods.score_mod.apply(merged, s, b_idx, h_idx, q_pos, k_pos)

            s, score_vjp = jax.vjp(score_mod, s, [consts[i] for i in floats])
        s = s * LOG2E
    segments = {}
    if q_segment_ids is not None:
        segments = dict(q_segment=q_segment_ids[:, None, None, :, None], kv_segment=seg_blk[:, None, None, None, :])
    visible = masks.visible(q_pos, k_pos, band=band, kv_len=kv_len, **segments)
    if mask_blk is not None:
        visible = mask_blk if visible is None else jnp.logical_and(visible, mask_blk)
    if block_mask is not None:  # expanded for this key chunk only: O(q_len * block_kv)
        tokens = block_sparse.token_mask(block_mask, q_pos[:, 0], k_pos[0], kv_heads)
        visible = block_sparse.combine(visible, tokens)
    if mods.mask_mod is not None:
        seen = mods.mask_mod.apply(mod_arrays.mask_consts, b_idx, h_idx, q_pos, k_pos)
        visible = seen if visible is None else jnp.logical_and(visible, seen)
    return (s if visible is None else jnp.where(visible, s, -jnp.inf)), grad_factor, score_vjp


def _dropout_scale(mods, mod_arrays, shape, start, block):
    """keep / (1 - rate) for one key block, [batch|1, kv_heads|1, group|1, q_len, block]; None without dropout."""
    if mods.dropout_rate == 0.0:
        return None
    batch, kv_heads, group, q_len = shape
    b, h = 0, 0
    if not mods.broadcast_dropout:
        b = jnp.arange(batch)[:, None, None, None, None]
        h = jnp.arange(kv_heads * group).reshape(1, kv_heads, group, 1, 1)
    keep = masks.dropout_keep_mask(
        mod_arrays.dropout_seed, b, h, jnp.arange(q_len)[:, None], start + jnp.arange(block)[None, :], mods.dropout_rate
    )
    return jnp.where(keep, 1.0 / (1.0 - mods.dropout_rate), 0.0)


def _scan_inputs(k, v, kv_segment_ids, mods, mod_arrays, kv_heads, block_kv):
    k_blocks, v_blocks = _blocks(k, block_kv), _blocks(v, block_kv)
    num_blocks = k_blocks.shape[0]
    bias_blocks, mask_blocks, bias, mask = _mod_blocks(mods, mod_arrays, kv_heads, block_kv, num_blocks)
    xs = (
        jnp.arange(num_blocks),
        k_blocks,
        v_blocks,
        _segment_blocks(kv_segment_ids, block_kv),
        bias_blocks,
        mask_blocks,
    )
    # A bias or mask that does not span kv_len is the same for every block.
    return xs, (bias if bias_blocks is None else None), (mask if mask_blocks is None else None)


def _visit(
    blk, q, q_segment_ids, mod_arrays, bias_const, mask_const, *, scale, band, kv_len, block_kv, mods, block_mask
):
    """One scanned key block -> (k block, v block, log2 logits, soft-cap factor or None, dropout
    multiplier or None, the score_mod's vjp or None)."""
    batch, q_len, kv_heads, group, _ = q.shape
    idx, k_blk, v_blk, seg_blk, bias_blk, mask_blk = blk
    start = idx * block_kv
    s, grad_factor, score_vjp = _block_logits2(
        q,
        k_blk,
        start,
        seg_blk,
        q_segment_ids,
        bias_const if bias_blk is None else bias_blk,
        mask_const if mask_blk is None else mask_blk,
        mod_arrays,
        scale=scale,
        band=band,
        kv_len=kv_len,
        mods=mods,
        block_mask=block_mask,
    )
    dropout = _dropout_scale(mods, mod_arrays, (batch, kv_heads, group, q_len), start, block_kv)
    return k_blk, v_blk, s, grad_factor, dropout, score_vjp


def _forward(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, block_kv, mods, block_mask):
    batch, q_len, kv_heads, group, _ = q.shape
    kv_len, dim = k.shape[1], v.shape[-1]
    block_kv = min(block_kv, kv_len)
    xs, bias_const, mask_const = _scan_inputs(k, v, kv_segment_ids, mods, mod_arrays, kv_heads, block_kv)
    visit = functools.partial(
        _visit,
        q=q,
        q_segment_ids=q_segment_ids,
        mod_arrays=mod_arrays,
        bias_const=bias_const,
        mask_const=mask_const,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_kv=block_kv,
        mods=mods,
        block_mask=block_mask,
    )

    def step(carry, blk):
        acc, m, l = carry
        _, v_blk, s, _, dropout, _ = visit(blk)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rows with nothing visible yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN.
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp2(s - shift[..., None])
        alpha = jnp.exp2(m - shift)
        l = alpha * l + jnp.sum(p, axis=-1)  # the un-dropped normaliser
        if dropout is not None:
            p = p * dropout
        pv = _einsum("bhgqk,bkhd->bhgqd", p.astype(v_blk.dtype), v_blk)
        return (alpha[..., None] * acc + pv, m_new, l), None

    init = (
        jnp.zeros((batch, kv_heads, group, q_len, dim), jnp.float32),
        jnp.full((batch, kv_heads, group, q_len), -jnp.inf, jnp.float32),
        jnp.zeros((batch, kv_heads, group, q_len), jnp.float32),
    )
    (acc, m, l), _ = jax.lax.scan(step, init, xs)
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) / LOG2E)
    return out, lse  # out [b, h, g, q, d_v] float32, lse [b, h, g, q]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _chunked(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, block_kv, mods, block_mask):
    return _forward(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, block_kv, mods, block_mask)


def _chunked_fwd(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, block_kv, mods, block_mask):
    out, lse = _forward(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, block_kv, mods, block_mask)
    return (out, lse), (q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, out, lse)


def _reduce_to(x, shape):
    """Sum x over the axes that `shape` broadcasts (size 1), keeping them."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _chunked_bwd(scale, band, block_kv, mods, block_mask, residuals, cotangents):
    q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, out, lse = residuals
    d_out, d_lse = cotangents
    kv_heads, kv_len = k.shape[2], k.shape[1]
    block_kv = min(block_kv, kv_len)
    # dL/ds = p * (dp - delta) with delta = rowsum(dO * O); a cotangent on lse adds p * d_lse. (out None: d_lse
    # holds -delta, `attention_backward`'s delta.)
    delta = -d_lse if out is None else jnp.sum(d_out * out, axis=-1) - d_lse
    # A row that saw no key has lse = -inf; +inf there makes every recomputed p exactly 0.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)
    d_out_lowp = d_out.astype(q.dtype)
    xs, bias_const, mask_const = _scan_inputs(k, v, kv_segment_ids, mods, mod_arrays, kv_heads, block_kv)
    has_bias = mod_arrays.bias is not None
    bias_blocked = has_bias and xs[4] is not None
    bias_shape = None if not has_bias else (bias_const.shape if not bias_blocked else xs[4].shape[1:])

    visit = functools.partial(
        _visit,
        q=q,
        q_segment_ids=q_segment_ids,
        mod_arrays=mod_arrays,
        bias_const=bias_const,
        mask_const=mask_const,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_kv=block_kv,
        mods=mods,
        block_mask=block_mask,
    )

    def step(carry, blk):
        dq, dbias_acc, d_consts = carry
        k_blk, v_blk, s, grad_factor, dropout, score_vjp = visit(blk)
        p = jnp.exp2(s - lse2[..., None])
        p_out = p if dropout is None else p * dropout  # the weights that multiplied V
        dv_blk = _einsum("bhgqk,bhgqd->bkhd", p_out.astype(q.dtype), d_out_lowp)
        dp = _einsum("bhgqd,bkhd->bhgqk", d_out_lowp, v_blk)
        if dropout is not None:
            dp = dp * dropout
        ds = p * (dp - delta[..., None])  # d loss / d logit (natural units)
        if score_vjp is not None:  # through the score_mod: d loss / d its input (= d bias), d its arrays
            ds, d_consts_blk = score_vjp(ds)
            d_consts = jax.tree.map(jnp.add, d_consts, d_consts_blk)
        dbias_blk = None
        if has_bias:
            dbias_blk = _reduce_to(ds, bias_shape)
            if not bias_blocked:
                dbias_acc, dbias_blk = dbias_acc + dbias_blk, None
        if grad_factor is not None:
            ds = ds * grad_factor
        ds = ds.astype(q.dtype)
        dq = dq + _einsum("bhgqk,bkhd->bqhgd", ds, k_blk)
        dk_blk = _einsum("bhgqk,bqhgd->bkhd", ds, q)
        return (dq, dbias_acc, d_consts), (dk_blk, dv_blk, dbias_blk)

    dbias_init = jnp.zeros(bias_shape, jnp.float32) if has_bias and not bias_blocked else None
    d_consts_init = [jnp.zeros_like(c) for c in mod_arrays.score_consts if jnp.issubdtype(c.dtype, jnp.inexact)]
    init = (jnp.zeros(q.shape, jnp.float32), dbias_init, d_consts_init)
    (dq, dbias, d_consts), (dk, dv, dbias_blocks) = jax.lax.scan(step, init, xs)

    def unblock(x):  # [num_blocks, batch, block_kv, kv_heads, dim] -> [batch, kv_len, kv_heads, dim]
        x = x.swapaxes(0, 1)
        return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :kv_len]

    if has_bias:
        if bias_blocked:  # [num_blocks, ..., block_kv] -> [..., kv_len]
            dbias = jnp.moveaxis(dbias_blocks, 0, -2)
            dbias = dbias.reshape(*dbias.shape[:-2], -1)[..., :kv_len]
        dbias = dbias.reshape(mod_arrays.bias.shape).astype(mod_arrays.bias.dtype)
    float_grads = iter(d_consts)
    d_consts = tuple(
        next(float_grads) if jnp.issubdtype(c.dtype, jnp.inexact) else masks.zero_cotangent(c)
        for c in mod_arrays.score_consts
    )
    d_mods = mod_arrays.cotangents(dbias if has_bias else None, d_consts if mods.score_mod is not None else None)
    return (
        (dq * scale).astype(q.dtype),
        (unblock(dk) * scale).astype(k.dtype),
        unblock(dv).astype(v.dtype),
        masks.integer_cotangent(q_segment_ids),
        masks.integer_cotangent(kv_segment_ids),
        d_mods,
    )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def attention_chunked(
    query,
    key,
    value,
    *,
    scale: float,
    band: masks.Band,
    block_kv: int,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_mask=None,
    mods: masks.ScoreMods = masks.ScoreMods(),
    mod_arrays: masks.ModArrays = masks.ModArrays(),
):
    """Blocked online-softmax attention. Shapes and results as `reference.attention_reference` (value's head_dim
    may differ from query's and key's); the score
    modifiers as checked by `api.flash_attention` (`masks.ScoreMods` and its `masks.ModArrays`). A
    `block_mask` is applied as a token mask per key chunk (no block is skipped: XLA's scan has a fixed
    trip count)."""
    batch, q_len, heads, dim = query.shape
    kv_heads = key.shape[2]
    q = query.reshape(batch, q_len, kv_heads, heads // kv_heads, dim)
    out, lse = _chunked(
        q, key, value, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, block_kv, mods, block_mask
    )
    out = jnp.moveaxis(out.reshape(batch, heads, q_len, value.shape[-1]), 1, 2).astype(query.dtype)
    return out, lse.reshape(batch, heads, q_len)
