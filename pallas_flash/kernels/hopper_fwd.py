"""FlashAttention forward for Hopper (sm90), written with Pallas's Mosaic GPU backend.

The FA3 recipe, one CTA per (batch, head, tile of `2 * block_q` queries):
  * three warpgroups: a producer that streams K/V blocks into a `num_stages`-deep shared-memory ring with
    TMA (each slot guarded by a "loaded" barrier that the TMA completes and a "consumed" barrier that both
    consumers arrive on), and two consumers, each owning `block_q` query rows;
  * S = Q K^T and O += P V on the tensor cores (wgmma); Q and K/V come from swizzled shared memory, P from
    registers;
  * ping-pong: a two-arrival "schedule" barrier alternates the consumers, so one warpgroup's softmax runs
    while the other's matmuls occupy the tensor cores;
  * online softmax in base 2 with the scale folded in: with c = scale * log2(e), p = exp2(s * c - m) is one
    FMA and one ex2 per logit, and m is kept in units of c * s;
  * causal block skipping: a CTA visits only key blocks up to its last row's diagonal; blocks wholly below
    the diagonal skip the mask;
  * the grid runs the query tiles of one (batch, head) back to back, so concurrent CTAs share K/V in L2; in
    the causal case the longest tiles (last rows) launch first.

Ragged lengths are padded in the wrapper (queries to `2 * block_q`, keys to `block_kv`); the padded keys are
masked in the last key block, the padded query rows sliced off. head_dim is padded to a multiple of 64 (the
wgmma contraction tile with a 128-byte swizzle). GQA is an index map: query head h reads kv head
h // (num_heads // num_kv_heads).

Residuals: the kernel returns (out, lse); lse [batch, heads, q_len] float32 in natural log, like the core.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.config import NUM_CONSUMERS, HopperConfig

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

HEAD_DIM_TILE = 64  # a 128-byte swizzle row of 16-bit elements: the wgmma contraction granule
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
# setmaxnreg budgets (multiples of 8, sum over warpgroups <= 64K / 128 threads): consumers hold the
# accumulator, the producer only issues TMAs.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def on_hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def padded_head_dim(head_dim: int) -> int:
    """head_dim as the kernel runs it: a multiple of the 64-element swizzle tile."""
    return _round_up(head_dim, HEAD_DIM_TILE)


def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped, *, scale: float, is_causal: bool, kv_len: int,
            num_q_tiles: int, group: int, config: HopperConfig, interpreting: bool):
    """Grid (batch, heads, q_tiles), 3 warpgroups ("wg"): 0 and 1 consume, 2 produces.

    `interpreting`: the Mosaic GPU interpreter (JAX 0.10-0.11) has no `pl.run_state` and no CPU rule for
    register layouts (`layout_cast`, `plgpu.broadcasted_iota`); there P V goes into a fresh accumulator
    that is then added, and layouts are left out. Same barriers, copies and wgmmas otherwise.

    q_ref [batch, q_pad, heads, d], k_ref/v_ref [batch, kv_pad, kv_heads, d], out_ref like q_ref,
    lse_ref [batch, heads, q_pad] (natural log)."""
    (qo_smem2, k_smem, v_smem, lse_smem2), q_ready, (k_ready, v_ready), (k_free, v_free), turn = scoped
    block_q, block_kv, num_stages = config.block_q, config.block_kv, config.num_stages
    num_kv_blocks = k_ref.shape[1] // block_kv
    dtype = q_ref.dtype
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    tile_start, kv_steps = query_tile_schedule(num_q_tiles, block_q=block_q, block_kv=block_kv,
                                               num_kv_blocks=num_kv_blocks, is_causal=is_causal)
    wg = lax.axis_index("wg")

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        q_start = tile_start + wg * block_q
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, block_q), head], qo_smem, q_ready.at[wg])

        def layout(x, layout):
            return x if interpreting else plgpu.layout_cast(x, layout)

        def iota(shape, axis):
            if interpreting:
                return lax.broadcasted_iota(jnp.int32, shape, axis)
            return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

        row = plgpu.Layout.WGMMA.reduce(1)
        m = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), row)
        l = layout(jnp.zeros((block_q,), jnp.float32), row)
        acc = layout(jnp.zeros((block_q, qo_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        c = scale * LOG2E  # logits in base-2 units: exp(scale * s) = exp2(c * s)

        plgpu.barrier_wait(q_ready.at[wg])
        plgpu.barrier_wait(k_ready.at[0])  # kv_steps >= 1 always: key 0 is visible to every query
        # Consumer 1 parks at the schedule barrier until consumer 0 has issued its first QK^T.
        pl.when(wg == 1)(take_turn)

        def step(kv_step, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(kv_step, num_stages)

            def qk(s_ref):
                plgpu.wgmma(s_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                plgpu.barrier_arrive(turn)  # our QK^T is queued: the other consumer may issue its PV
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(turn)
            if masked:
                k_pos = kv_step * block_kv + iota(s.shape, 1)
                visible = k_pos <= q_start + iota(s.shape, 0) if is_causal else None
                if kv_len % block_kv:
                    in_range = k_pos < kv_len
                    visible = in_range if visible is None else jnp.logical_and(visible, in_range)
                if visible is not None:  # None: traced for a loop that runs no iterations
                    s = jnp.where(visible, s, -jnp.inf)
            # c > 0, so max(c * s) = c * max(s); key 0 is visible to every row, so m is finite from the
            # first block on and exp2 never sees (-inf) - (-inf).
            m_new = jnp.maximum(m, s.max(axis=1) * c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                @pl.when(kv_step + 1 < kv_steps)
                def _():  # overlap the next K block's wait with this PV
                    plgpu.barrier_wait(k_ready.at[lax.rem(kv_step + 1, num_stages)])

            if interpreting:
                acc = acc + pl.run_scoped(lambda acc_ref: (pv(acc_ref), acc_ref[...])[1],
                                          plgpu.ACC(acc.shape, jnp.float32))
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        # Blocks [0, first_masked) are visible to every row of this warpgroup: no mask.
        carry = (acc, m, l)
        if is_causal:
            first_masked = jnp.minimum(kv_len // block_kv, q_start // block_kv)
            carry = lax.fori_loop(0, first_masked, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(first_masked, kv_steps, functools.partial(step, masked=True), carry)
        else:
            first_masked = kv_len // block_kv
            carry = lax.fori_loop(0, first_masked, functools.partial(step, masked=False), carry)
            # The ragged last block, if any (a loop, not a call: the step index must be a traced value).
            carry = lax.fori_loop(first_masked, kv_steps, functools.partial(step, masked=True), carry)
        acc, m, l = carry
        pl.when(wg == 0)(take_turn)  # balance consumer 1's opening turn

        inv_l = 1.0 / l
        qo_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
        lse_smem[...] = (m + jnp.log2(l)) * LN2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_start, block_q), head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_start, block_q)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        stream_kv_blocks((k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free), batch=batch,
                         kv_head=lax.div(head, group), block_kv=block_kv, num_stages=num_stages, kv_steps=kv_steps)


def query_tile_schedule(num_q_tiles: int, *, block_q: int, block_kv: int, num_kv_blocks: int, is_causal: bool):
    """The first query row of this CTA's tile of NUM_CONSUMERS * block_q rows (grid axis "q_tiles"), and how
    many key blocks it visits: all of them, or (causal) those up to the diagonal of its last row. Causal
    tiles run in reverse: the last ones visit the most key blocks, so they launch first. Shared by the
    forward and the dQ kernel."""
    tile = lax.axis_index("q_tiles")
    if is_causal:
        tile = num_q_tiles - 1 - tile
    tile_start = tile * (NUM_CONSUMERS * block_q)
    if not is_causal:
        return tile_start, num_kv_blocks
    return tile_start, jnp.minimum(pl.cdiv(tile_start + NUM_CONSUMERS * block_q, block_kv), num_kv_blocks)


def stream_kv_blocks(gmem, smem, ready, free, *, batch, kv_head, block_kv: int, num_stages: int, kv_steps):
    """The producer warpgroup's loop (this forward's and the dQ kernel's): TMA key/value blocks 0 .. kv_steps-1
    of (batch, kv_head) into a `num_stages` shared-memory ring. `gmem`, `smem`, `ready`, `free` are (key,
    value) pairs of refs and barriers; slot s is refilled once the consumers arrive on its "free" barrier.
    K of step i + num_stages may land once both consumers finished Q K^T of step i, before they finish its
    P V: K and V have separate "free" barriers."""

    def load(kv_step, slot, wait_free: bool):
        rows = (batch, pl.ds(kv_step * block_kv, block_kv), kv_head)
        for ref, ring, is_ready, is_free in zip(gmem, smem, ready, free):
            if wait_free:
                plgpu.barrier_wait(is_free.at[slot])
            plgpu.copy_gmem_to_smem(ref.at[rows], ring.at[slot], is_ready.at[slot])

    fill_ring(load, num_stages=num_stages, steps=kv_steps)


def fill_ring(load, *, num_stages: int, steps):
    """A producer's loop over a `num_stages` shared-memory ring: `load(step, slot, wait_free)` for steps
    0 .. steps-1, the first `num_stages` into empty slots, each later one into slot step % num_stages once
    `load` has waited for the consumers to free it (wait_free=True)."""

    @pl.loop(0, jnp.minimum(num_stages, steps))
    def _fill(step):
        load(step, step, wait_free=False)

    @pl.loop(num_stages, steps)
    def _stream(step):
        load(step, lax.rem(step, num_stages), wait_free=True)


def _forward_padded(q, k, v, *, scale: float, is_causal: bool, kv_len: int, config: HopperConfig,
                    interpret):
    batch, q_pad, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    num_q_tiles = q_pad // (NUM_CONSUMERS * config.block_q)
    # 128-byte swizzle over (8, 64)-element tiles: the layout wgmma reads without bank conflicts.
    transforms = (plgpu.TilingTransform((8, HEAD_DIM_TILE)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
        smem = (
            plgpu.SMEM((NUM_CONSUMERS, config.block_q, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((config.num_stages, config.block_kv, head_dim), k.dtype, transforms=transforms),
            plgpu.SMEM((config.num_stages, config.block_kv, head_dim), v.dtype, transforms=transforms),
            plgpu.SMEM((NUM_CONSUMERS, config.block_q), jnp.float32),
        )
        body = functools.partial(_kernel, scale=scale, is_causal=is_causal, kv_len=kv_len,
                                 num_q_tiles=num_q_tiles, group=heads // kv_heads, config=config,
                                 interpreting=interpret is not None)
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped),
            smem,
            plgpu.Barrier(num_barriers=NUM_CONSUMERS),
            (plgpu.Barrier(num_barriers=config.num_stages),) * 2,
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=config.num_stages),) * 2,
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)),
        grid=(batch, heads, num_q_tiles),
        grid_names=("batch", "heads", "q_tiles"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else dict(interpret=interpret)),
    )(q, k, v)


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "config", "interpret"))
def hopper_forward(query, key, value, *, scale: float, is_causal: bool, config: HopperConfig | None = None,
                   interpret=None):
    """Attention forward on Hopper. Shapes and results as `reference.attention_reference`:
    query [batch, q_len, heads, head_dim], key/value [batch, kv_len, kv_heads, head_dim] ->
    (out [batch, q_len, heads, head_dim] in query's dtype, lse [batch, heads, q_len] float32).

    `interpret`: None compiles for the GPU; an `InterpretGPUParams` (private in JAX 0.10-0.11:
    jax._src.pallas.mosaic_gpu.interpret.params) runs the kernel in the Mosaic GPU interpreter on CPU."""
    q_len, kv_len, head_dim = query.shape[1], key.shape[1], query.shape[3]
    padded_dim = padded_head_dim(head_dim)
    config = config or HopperConfig.default(padded_dim, kv_len, is_causal)
    q = _pad_axis(_pad_axis(query, 1, _round_up(q_len, NUM_CONSUMERS * config.block_q)), 3, padded_dim)
    k = _pad_axis(_pad_axis(key, 1, _round_up(kv_len, config.block_kv)), 3, padded_dim)
    v = _pad_axis(_pad_axis(value, 1, _round_up(kv_len, config.block_kv)), 3, padded_dim)
    out, lse = _forward_padded(q, k, v, scale=scale, is_causal=is_causal, kv_len=kv_len, config=config,
                               interpret=interpret)
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len]
