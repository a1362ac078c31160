"""Backward FlashAttention kernels in generic Pallas: recompute P from the saved LSE, never store it.

With delta = rowsum(dO * O) (minus the LSE's own cotangent, if any), per tile:
    P = exp2(S * scale * log2(e) - LSE * log2(e))      dV += P^T dO
    dP = dO V^T      dS = P * (dP - delta)             dK += scale * dS^T Q      dQ += scale * dS K
Two kernels, both deterministic (each output tile is owned by one program; no atomics):
  * dK/dV: grid (key block, batch, kv head); loops over the query heads that share the kv head (the GQA
    reduction happens in registers) and over the query blocks that see the key block (the band's range, or
    with a block mask the key block's row of a visit table, per query head). It works on the
    transposed tiles S^T = K Q^T, so that P^T and dS^T come out of the matmuls in the layout the next
    matmuls (P^T dO, dS^T Q) consume, with no transposes of register tiles.
  * dQ: grid (query block, batch, head); loops over the key blocks the query block sees (band or visit table).
A visit table (`block_sparse.visit_tables`) is the optional first operand; blocks it does not list are never
loaded.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash import masks
from pallas_flash._compat import SQUEEZED, triton_params
from pallas_flash.kernels import tiles


def _dkdv_kernel(*refs, scale, band, kv_len, block_q, block_kv, num_q_blocks, group, has_segments, has_visits):
    visits_ref, refs = (refs[0], refs[1:]) if has_visits else (None, refs)
    if has_segments:
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_seg_ref, kv_seg_ref, dk_ref, dv_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref), q_seg_ref = refs, None
    kv_block = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kv_seg = kv_seg_ref[...] if has_segments else None
    k_start = kv_block * block_kv
    logit_scale = scale * tiles.LOG2E

    def visit(q_block, carry, *, head, masked):
        dk, dv = carry
        q_slice = pl.ds(q_block * block_q, block_q)
        q, do = q_ref[q_slice, head, :], do_ref[q_slice, head, :]
        s_t = tiles.dot(k, q, trans_b=True) * logit_scale  # [block_kv, block_q]
        if masked:
            mask = tiles.tile_mask(q_block * block_q, k_start, block_q, block_kv, band=band, kv_len=kv_len,
                                   q_segment=q_seg_ref[q_slice] if has_segments else None, kv_segment=kv_seg,
                                   keys_major=True)
            s_t = jnp.where(mask, s_t, -jnp.inf)
        p_t = jnp.exp2(s_t - lse2_ref[head, q_slice][None, :])
        dv = dv + tiles.dot(p_t.astype(do.dtype), do)
        dp_t = tiles.dot(v, do, trans_b=True)
        ds_t = p_t * (dp_t - delta_ref[head, q_slice][None, :])
        dk = dk + tiles.dot(ds_t.astype(q.dtype), q)
        return dk, dv

    if not has_visits:
        lo, unmasked_lo, unmasked_hi, hi = tiles.q_block_range(
            kv_block, block_q=block_q, block_kv=block_kv, num_q_blocks=num_q_blocks, kv_len=kv_len, band=band,
            always_mask=has_segments)

    def per_head(head, carry):
        if has_visits:  # block-sparse: the table lists the query blocks that see this key block, per head
            row = head if visits_ref.shape[0] > 1 else 0
            return tiles.visit_blocks(lambda i: visits_ref[row, i], functools.partial(visit, head=head), carry)
        carry = lax.fori_loop(lo, unmasked_lo, functools.partial(visit, head=head, masked=True), carry)
        carry = lax.fori_loop(unmasked_lo, unmasked_hi, functools.partial(visit, head=head, masked=False), carry)
        return lax.fori_loop(unmasked_hi, hi, functools.partial(visit, head=head, masked=True), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, scale, band, kv_len, block_q, block_kv, num_q_blocks, num_kv_blocks, has_segments, has_visits):
    visits_ref, refs = (refs[0], refs[1:]) if has_visits else (None, refs)
    if has_segments:
        q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref), kv_seg_ref = refs, None
    q_block = tiles.launch_order(pl.program_id(0), num_q_blocks, reverse=band.right == 0)
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse2_ref[...], delta_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None
    logit_scale = scale * tiles.LOG2E

    def visit(kv_block, dq, *, masked):
        k_slice = pl.ds(kv_block * block_kv, block_kv)
        k, v = k_ref[k_slice, :], v_ref[k_slice, :]
        s = tiles.dot(q, k, trans_b=True) * logit_scale
        if masked:
            mask = tiles.tile_mask(q_block * block_q, kv_block * block_kv, block_q, block_kv, band=band,
                                   kv_len=kv_len, q_segment=q_seg,
                                   kv_segment=kv_seg_ref[k_slice] if has_segments else None)
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - lse2[:, None])
        dp = tiles.dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + tiles.dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    if has_visits:  # block-sparse: the table lists this query block's key blocks
        dq = tiles.visit_blocks(lambda i: visits_ref[i], visit, dq)
    else:
        lo, unmasked_lo, unmasked_hi, hi = tiles.kv_block_range(
            q_block, block_q=block_q, block_kv=block_kv, num_kv_blocks=num_kv_blocks, kv_len=kv_len, band=band,
            always_mask=has_segments)
        dq = lax.fori_loop(lo, unmasked_lo, functools.partial(visit, masked=True), dq)
        dq = lax.fori_loop(unmasked_lo, unmasked_hi, functools.partial(visit, masked=False), dq)
        dq = lax.fori_loop(unmasked_hi, hi, functools.partial(visit, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def dkdv(q, k, v, do, lse2, delta, q_segment_ids=None, kv_segment_ids=None, visits=None, *, scale, band: masks.Band,
         kv_len, block_q, block_kv, num_warps, num_stages, interpret):
    """dK, dV [batch, kv_pad, kv_heads, head_dim_pad] from padded inputs (see `backward`)."""
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    has_segments = q_segment_ids is not None
    kernel = functools.partial(_dkdv_kernel, scale=scale, band=band, kv_len=kv_len, block_q=block_q,
                               block_kv=block_kv, num_q_blocks=q_pad // block_q, group=group,
                               has_segments=has_segments, has_visits=visits is not None)
    # A program reads all query rows of the `group` query heads that share its kv head.
    q_group_spec = pl.BlockSpec((SQUEEZED, q_pad, group, head_dim), lambda j, b, h: (b, 0, h, 0))
    row_group_spec = pl.BlockSpec((SQUEEZED, group, q_pad), lambda j, b, h: (b, h, 0))
    kv_block_spec = pl.BlockSpec((SQUEEZED, block_kv, SQUEEZED, head_dim), lambda j, b, h: (b, j, h, 0))
    in_specs = [q_group_spec, kv_block_spec, kv_block_spec, q_group_spec, row_group_spec, row_group_spec]
    operands = [q, k, v, do, lse2, delta]
    if has_segments:
        in_specs += [pl.BlockSpec((SQUEEZED, q_pad), lambda j, b, h: (b, 0)),
                     pl.BlockSpec((SQUEEZED, block_kv), lambda j, b, h: (b, j))]
        operands += [q_segment_ids, kv_segment_ids]
    if visits is not None:
        in_specs = [tiles.visits_spec(visits.shape, lambda j: j, group=group)] + in_specs
        operands = [visits] + operands
    return pl.pallas_call(
        kernel,
        grid=(kv_pad // block_kv, batch, kv_heads),
        in_specs=in_specs,
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_backward_dkdv",
    )(*operands)


def dq(q, k, v, do, lse2, delta, q_segment_ids=None, kv_segment_ids=None, visits=None, *, scale, band: masks.Band,
       kv_len, block_q, block_kv, num_warps, num_stages, interpret):
    """dQ [batch, q_pad, heads, head_dim_pad] from padded inputs (see `backward`)."""
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_q_blocks = q_pad // block_q
    has_segments = q_segment_ids is not None
    kernel = functools.partial(_dq_kernel, scale=scale, band=band, kv_len=kv_len, block_q=block_q,
                               block_kv=block_kv, num_q_blocks=num_q_blocks, num_kv_blocks=kv_pad // block_kv,
                               has_segments=has_segments, has_visits=visits is not None)

    def q_block_of(i):
        return tiles.launch_order(i, num_q_blocks, reverse=band.right == 0)

    q_block_spec = pl.BlockSpec((SQUEEZED, block_q, SQUEEZED, head_dim), lambda i, b, h: (b, q_block_of(i), h, 0))
    kv_full_spec = pl.BlockSpec((SQUEEZED, kv_pad, SQUEEZED, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda i, b, h: (b, h, q_block_of(i)))
    in_specs = [q_block_spec, kv_full_spec, kv_full_spec, q_block_spec, row_spec, row_spec]
    operands = [q, k, v, do, lse2, delta]
    if has_segments:
        in_specs += [pl.BlockSpec((SQUEEZED, block_q), lambda i, b, h: (b, q_block_of(i))),
                     pl.BlockSpec((SQUEEZED, kv_pad), lambda i, b, h: (b, 0))]
        operands += [q_segment_ids, kv_segment_ids]
    if visits is not None:
        in_specs, operands = [tiles.visits_spec(visits.shape, q_block_of)] + in_specs, [visits] + operands
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=in_specs,
        out_specs=q_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_backward_dq",
    )(*operands)


def backward(q, k, v, do, lse2, delta, q_segment_ids=None, kv_segment_ids=None, dkdv_visits=None, dq_visits=None,
             *, scale, band, kv_len, config, interpret):
    """Padded inputs -> (dq, dk, dv).

    q, do: [batch, q_pad, heads, head_dim_pad]; k, v: [batch, kv_pad, kv_heads, head_dim_pad];
    lse2, delta: [batch, heads, q_pad] float32, lse2 = LSE * log2(e) with +inf on rows that saw no key
    (their recomputed P is then exactly 0); optional segment ids int32 [batch, q_pad] / [batch, kv_pad];
    optional visit tables (`block_sparse.visit_tables`): per key block of the dK/dV kernel the query blocks
    to visit, per query block of the dQ kernel the key blocks.
    q_pad must be a multiple of both query blocks of `config`, kv_pad of both key blocks; `kv_len` is the
    unpadded key length.
    """
    common = dict(scale=scale, band=band, kv_len=kv_len, interpret=interpret)
    segments = (q_segment_ids, kv_segment_ids)
    dk, dv = dkdv(q, k, v, do, lse2, delta, *segments, dkdv_visits, block_q=config.block_q_dkv, block_kv=config.block_kv_dkv,
                  num_warps=config.num_warps_dkv, num_stages=config.num_stages_dkv, **common)
    dq_ = dq(q, k, v, do, lse2, delta, *segments, dq_visits, block_q=config.block_q_dq, block_kv=config.block_kv_dq,
             num_warps=config.num_warps_dq, num_stages=config.num_stages_dq, **common)
    return dq_, dk, dv
