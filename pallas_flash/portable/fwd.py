"""Forward FlashAttention kernel in generic Pallas (FA2 loop order).

Grid: (query block, batch, head). Each program owns `block_q` query rows of one head, keeps them and
their output accumulator on chip, and loops over key blocks of its kv head with online softmax in the
log2 domain (scale * log2(e) folded into the logits, so the exponentials are exp2). It visits only the
key blocks inside its band (causal: at or below the diagonal; a local window: near it), and only tiles
that cross the band's edges, hold the padded key tail, or carry segment ids pay for the band mask. With a
block mask or a mask_mod, the optional first operand is a visit table (`block_sparse.visit_tables`, or
the device-side one of `portable.vjp`): the program loops over the key blocks its row lists, fully visible
ones first, and never loads the others. Score modifiers (bias, boolean mask, ALiBi, soft cap, score_mod,
dropout; `tiles.modified_logits`) apply in every tile it visits, the mask_mod in its partly visible tiles;
their operands follow the segment ids (`tiles.mod_operands`).
Outputs: O [batch, q_len, heads, head_dim_v] and the natural-log LSE [batch, heads, q_len], the
backward's only residual besides the inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_flash import blocks, masks
from pallas_flash._compat import SQUEEZED, triton_params
from pallas_flash.portable import tiles


def _forward_kernel(
    *refs, scale, band, kv_len, block_q, block_kv, num_q_blocks, num_kv_blocks, has_segments, has_visits, mods
):
    visits_ref, refs = (refs[0], refs[1:]) if has_visits else (None, refs)
    (q_ref, k_ref, v_ref), (q_seg_ref, kv_seg_ref), mod_refs, (o_ref, lse_ref) = tiles.split_refs(
        refs, 3, has_segments, mods
    )
    q_block = tiles.launch_order(pl.program_id(0), num_q_blocks, reverse=band.right == 0)
    batch, head = pl.program_id(1), pl.program_id(2)  # read here: interpret mode has no program_id in loops
    q = q_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None
    logit_scale = scale * blocks.LOG2E

    def visit(kv_block, carry, *, masked):
        acc, row_max, row_sum = carry
        k_slice = pl.ds(kv_block * block_kv, block_kv)
        s = tiles.dot(q, k_ref[k_slice, :], trans_b=True)
        position = dict(
            batch=batch,
            head=head,
            q_start=q_block * block_q,
            k_start=kv_block * block_kv,
            block_q=block_q,
            block_kv=block_kv,
        )
        if mods.active:  # the plain kernel keeps its single multiply
            s, _, _ = tiles.modified_logits(s * scale, mods, mod_refs, **position)
        else:
            s = s * logit_scale
        if masked:
            mask = tiles.tile_mask(
                q_block * block_q,
                kv_block * block_kv,
                block_q,
                block_kv,
                band=band,
                kv_len=kv_len,
                q_segment=q_seg,
                kv_segment=kv_seg_ref[k_slice] if has_segments else None,
            )
            s = jnp.where(tiles.visibility(mask, mods, mod_refs, **position), s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        shift = blocks.safe_exp_shift(new_max)
        p = jnp.exp2(s - shift[:, None])
        correction = jnp.exp2(row_max - shift)
        row_sum = correction * row_sum + jnp.sum(p, axis=1)  # un-dropped: the LSE is dropout's input's
        dropout = tiles.dropout_multiplier(mods, mod_refs, **position)
        if dropout is not None:
            p = p * dropout
        v = v_ref[k_slice, :]
        acc = correction[:, None] * acc + tiles.dot(p.astype(v.dtype), v)
        return acc, new_max, row_sum

    carry = (
        jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    if has_visits:  # block-sparse: the table lists this query block's key blocks
        acc, row_max, row_sum = tiles.visit_blocks(lambda i: visits_ref[i], visit, carry)
    else:
        acc, row_max, row_sum = tiles.visit_band(
            visit,
            carry,
            blocks.kv_block_range(
                q_block,
                block_q=block_q,
                block_kv=block_kv,
                num_kv_blocks=num_kv_blocks,
                kv_len=kv_len,
                band=band,
                always_mask=has_segments,
            ),
        )

    empty = row_sum == 0.0  # no visible key: output 0, lse -inf
    safe_sum = jnp.where(empty, 1.0, row_sum)
    o_ref[...] = (acc / safe_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (row_max + jnp.log2(safe_sum)) * blocks.LN2)


def forward(
    q,
    k,
    v,
    q_segment_ids=None,
    kv_segment_ids=None,
    mod_arrays=masks.ModArrays(),
    visits=None,
    *,
    scale,
    band: masks.Band,
    kv_len,
    block_q,
    block_kv,
    num_warps,
    num_stages,
    interpret,
    mods: masks.ScoreMods = masks.ScoreMods(),
    stacks: tiles.ProgramStacks = tiles.ProgramStacks(),
):
    """Padded inputs -> (O, LSE).

    q: [batch, q_pad, heads, head_dim_pad]; k: [batch, kv_pad, kv_heads, head_dim_pad]; v: [batch, kv_pad,
    kv_heads, head_dim_v_pad], with q_pad a multiple of block_q, kv_pad of block_kv, both head dims powers of
    two; optional segment ids int32 [batch, q_pad] / [batch, kv_pad]. `kv_len` is the unpadded key length.
    Optional `visits`: int32 [batch or 1, heads or 1, q_pad // block_q, width], the key blocks of each query block
    (`block_sparse.visit_tables`); without it the band decides. The score modifiers `mods` come with their
    unpadded `mod_arrays` and the score_mod's / mask_mod's unpadded `stacks` (`tiles.mod_operands` pads
    them); with a mask_mod, `visits` must list only the blocks it may show, and its masked (partly visible)
    blocks are those the mask_mod is evaluated on. Returns o [batch, q_pad, heads, head_dim_v_pad] in q's
    dtype and lse [batch, heads, q_pad] float32.
    """
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_q_blocks, num_kv_blocks = q_pad // block_q, kv_pad // block_kv
    has_segments = q_segment_ids is not None

    def q_block_of(i):
        return tiles.launch_order(i, num_q_blocks, reverse=band.right == 0)

    q_spec, o_spec = tiles.head_specs(block_q, lambda i, b, h: (b, q_block_of(i), h, 0), head_dim, v.shape[3])
    k_spec, v_spec = tiles.head_specs(kv_pad, lambda i, b, h: (b, 0, h // group, 0), head_dim, v.shape[3])
    lse_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda i, b, h: (b, h, q_block_of(i)))
    in_specs, operands = [q_spec, k_spec, v_spec], [q, k, v]
    if has_segments:
        in_specs += [
            pl.BlockSpec((SQUEEZED, block_q), lambda i, b, h: (b, q_block_of(i))),
            pl.BlockSpec((SQUEEZED, kv_pad), lambda i, b, h: (b, 0)),
        ]
        operands += [q_segment_ids, kv_segment_ids]
    mod_ops, mod_specs = tiles.mod_operands(mods, mod_arrays, q_pad, kv_pad, stacks=stacks)
    in_specs, operands = in_specs + mod_specs, operands + mod_ops
    if visits is not None:
        in_specs, operands = [tiles.visits_spec(visits.shape, q_block_of)] + in_specs, [visits] + operands
    kernel = functools.partial(
        _forward_kernel,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        num_q_blocks=num_q_blocks,
        num_kv_blocks=num_kv_blocks,
        has_segments=has_segments,
        has_visits=visits is not None,
        mods=mods,
    )
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=in_specs,
        out_specs=[o_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32),
        ],
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_forward",
    )(*operands)
