"""Context parallelism: exact attention over a sequence sharded along a mesh axis, on our kernels.

Inside `jax.shard_map`, each device holds a contiguous shard of the sequence (or, with the zig-zag layout, two
chunks of it, `to_zigzag`) and calls `ring_attention` on its shard with the axis name. Two strategies:
  * "ring": K/V (with the key segment ids) travel around the axis with `lax.ppermute`; at each step a device
    attends its queries to the K/V it holds, and the partial outputs merge through their LSE
    (`merge_attention_states`). The next step's transfer is issued before this step's kernel, so XLA overlaps
    them. The backward is its own custom_vjp: K/V travel again with their dK/dV accumulators, which arrive home
    after a full turn; each step's gradient is the backward kernels' on the merged out and lse (no step's forward
    runs again). Fixed order everywhere: bitwise deterministic.
  * "all_gather": K/V gathered once, then one local call (its gradient is reduce-scattered by autodiff). Cheaper
    for short sequences or small K/V (GQA/MQA), where a ring's steps are too short to hide their transfers.
Causal attention with the contiguous layout leaves device r idle for the steps that bring later shards; the
zig-zag layout (device r holds chunks r and 2n-1-r of 2n) gives every device the same work at every step, and
its steps are static cases (causal on the diagonal, all queries against the first key chunk, the second query
chunk against all keys). Windows and anything else position-dependent use a mask_mod on global positions.

`context_parallel_attention` wraps this for plain `jit` callers with sequence-sharded arrays.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash import masks
from pallas_flash.api import attention_backward, flash_attention
from pallas_flash.decode import merge_attention_states

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "all_gather")
# all_gather serves when the whole sequence's K/V is at most this many tokens, or for MQA-like groups: a ring step
# then computes too little to hide its transfer.
ALL_GATHER_MAX_TOKENS = 8192
ALL_GATHER_MIN_GROUP = 8


# ---- layouts ---------------------------------------------------------------------------------------------------


def zigzag_order(seq_len: int, num_shards: int) -> np.ndarray:
    """Token order of the zig-zag layout: position i of the permuted sequence holds token order[i]; shard r of
    the permuted sequence (contiguous split in num_shards) holds chunks r and 2 * num_shards - 1 - r of the
    original's 2 * num_shards chunks. Use it to permute tokens and the positions of rotary embeddings."""
    if seq_len % (2 * num_shards):
        raise ValueError(f"seq_len {seq_len} must be a multiple of 2 * num_shards = {2 * num_shards} for zig-zag")
    chunk = seq_len // (2 * num_shards)
    chunks = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def to_zigzag(x, num_shards: int, axis: int = 1):
    """x with its sequence axis in zig-zag order (`zigzag_order`)."""
    return jnp.take(x, zigzag_order(x.shape[axis], num_shards), axis=axis)


def from_zigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `to_zigzag`."""
    return jnp.take(x, np.argsort(zigzag_order(x.shape[axis], num_shards)), axis=axis)


def shard_positions(local_len: int, shard, num_shards: int, layout: str):
    """int32 [local_len]: the global positions of shard `shard`'s tokens (traced shard index allowed)."""
    i = jnp.arange(local_len, dtype=jnp.int32)
    if layout == "contiguous":
        return shard * local_len + i
    half = local_len // 2
    chunk = jnp.where(i < half, shard, 2 * num_shards - 1 - shard)
    return chunk * half + i % half


def choose_strategy(seq_len: int, heads: int, kv_heads: int) -> str:
    """The documented default: "all_gather" for sequences of at most ALL_GATHER_MAX_TOKENS tokens or query groups of
    ALL_GATHER_MIN_GROUP heads or more per K/V head, else "ring"."""
    if seq_len <= ALL_GATHER_MAX_TOKENS or heads // kv_heads >= ALL_GATHER_MIN_GROUP:
        return "all_gather"
    return "ring"


# ---- one ring step ---------------------------------------------------------------------------------------------

FULL, CAUSAL, SKIP, KV_FIRST_HALF, Q_SECOND_HALF, POSITIONS = range(6)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of a ring call: layout, the band on global positions, and flash_attention's options."""

    layout: str
    num_shards: int
    band: masks.Band
    options: tuple  # flash_attention keyword arguments, as sorted (name, value) pairs

    def case(self, shard, source):
        """The step case (traced int) for queries of `shard` against K/V of `source`."""
        if self.band.is_full:
            return jnp.int32(FULL)
        if not self.band.is_causal:
            return jnp.int32(POSITIONS)
        if self.layout == "contiguous":
            return jnp.where(source < shard, FULL, jnp.where(source == shard, CAUSAL, SKIP)).astype(jnp.int32)
        return jnp.where(source < shard, KV_FIRST_HALF, jnp.where(source == shard, CAUSAL, Q_SECOND_HALF)).astype(
            jnp.int32
        )

    def cases(self) -> tuple:
        if self.band.is_full:
            return (FULL,)
        if not self.band.is_causal:
            return (POSITIONS,)
        return (FULL, CAUSAL, SKIP) if self.layout == "contiguous" else (CAUSAL, KV_FIRST_HALF, Q_SECOND_HALF)


def _band_mask(band, q_pos, kv_pos):
    """The band on global positions as a mask_mod (the POSITIONS case): q_pos / kv_pos int32 [q_len] / [kv_len]."""
    left, right = band.left, band.right

    def mask_mod(b, h, qi, ki):
        seen = jnp.bool_(True)
        if left is not None:
            seen = seen & (kv_pos[ki] >= q_pos[qi] - left)
        if right is not None:
            seen = seen & (kv_pos[ki] <= q_pos[qi] + right)
        return seen

    return mask_mod


def _options(plan, case, q_ids, kv_ids, q_pos, kv_pos):
    """flash_attention's (and attention_backward's) keyword arguments for a FULL, CAUSAL or POSITIONS step; the
    half cases slice their inputs down to a FULL step."""
    options = dict(plan.options)
    if q_ids is not None:
        options.update(segment_ids=q_ids, kv_segment_ids=kv_ids)
    if case == CAUSAL:
        options["is_causal"] = True
    if case == POSITIONS:
        options["mask_mod"] = _band_mask(plan.band, q_pos, kv_pos)
    return options


def _cols(x, start, stop):
    """x[:, start:stop] (a slice of the sequence axis), None for None."""
    return None if x is None else x[:, start:stop]


def _step(plan, case, q, k, v, q_ids, kv_ids, q_pos, kv_pos):
    """(out, lse) of the local queries against the K/V held now, for a case that involves every local query."""
    if case == KV_FIRST_HALF:  # every local query sees the first key chunk whole, the second not at all
        half = k.shape[1] // 2
        options = _options(plan, FULL, q_ids, _cols(kv_ids, 0, half), q_pos, kv_pos)
        return flash_attention(q, k[:, :half], v[:, :half], return_lse=True, **options)
    return flash_attention(q, k, v, return_lse=True, **_options(plan, case, q_ids, kv_ids, q_pos, kv_pos))


def _merge_step(plan, case, acc, q, k, v, q_ids, kv_ids, q_pos, kv_pos):
    """`acc` (out float32, lse) merged with the local queries' attention to the K/V held now, for one static case;
    rows no key held is visible to are left as they are."""
    if case == SKIP:
        return acc
    if case == Q_SECOND_HALF:  # the second query chunk sees every key held; the first sees none
        half = q.shape[1] // 2
        options = _options(plan, FULL, _cols(q_ids, half, None), kv_ids, q_pos, kv_pos)
        part = flash_attention(q[:, half:], k, v, return_lse=True, **options)
        out, lse = _merge((acc[0][:, half:], acc[1][:, :, half:]), part)
        return acc[0].at[:, half:].set(out), acc[1].at[:, :, half:].set(lse)
    return _merge(acc, _step(plan, case, q, k, v, q_ids, kv_ids, q_pos, kv_pos))


def _add(acc, part, start=0):
    """acc with `part` added to its sequence rows [start, start + len): in float32, rounded once to acc's dtype."""
    stop = start + part.shape[1]
    return acc.at[:, start:stop].set(
        (acc[:, start:stop].astype(jnp.float32) + part.astype(jnp.float32)).astype(acc.dtype)
    )


def _step_grad(plan, case, grads, q, k, v, q_ids, kv_ids, q_pos, kv_pos, out, lse, d_out, d_lse):
    """`grads` (dq, dk, dv accumulators) plus the part of the ring's gradient that flows through the K/V held now,
    for one static case, from the ring's merged (out, lse) and their cotangents (`attention_backward`); sliced as
    `_step` slices, each part added to the rows it covers only."""
    dq, dk, dv = grads
    if case == SKIP:
        return grads
    if case == KV_FIRST_HALF:  # the second key chunk is seen by no local query: zero gradient
        half = k.shape[1] // 2
        options = _options(plan, FULL, q_ids, _cols(kv_ids, 0, half), q_pos, kv_pos)
        parts = attention_backward(q, k[:, :half], v[:, :half], out, lse, d_out, d_lse, **options)
        return _add(dq, parts[0]), _add(dk, parts[1]), _add(dv, parts[2])
    if case == Q_SECOND_HALF:  # the first query chunk sees no key held: zero gradient
        half = q.shape[1] // 2
        options = _options(plan, FULL, _cols(q_ids, half, None), kv_ids, q_pos, kv_pos)
        rows = (out[:, half:], lse[:, :, half:], d_out[:, half:], d_lse[:, :, half:])
        parts = attention_backward(q[:, half:], k, v, *rows, **options)
        return _add(dq, parts[0], half), _add(dk, parts[1]), _add(dv, parts[2])
    options = _options(plan, case, q_ids, kv_ids, q_pos, kv_pos)
    parts = attention_backward(q, k, v, out, lse, d_out, d_lse, **options)
    return tuple(_add(g, p) for g, p in zip(grads, parts))


def _switch(plan, step, case, *args):
    """`step` (`_merge_step` or `_step_grad`) for a traced case: one branch per case the plan can meet."""
    cases = plan.cases()
    if len(cases) == 1:
        return step(plan, cases[0], *args)
    index = sum(jnp.where(case == c, i, 0) for i, c in enumerate(cases))
    return lax.switch(index, [functools.partial(step, plan, c) for c in cases], *args)


def _merge(acc, part):
    """Running (out float32 [B, Tq, H, D], lse [B, H, Tq]) merged with one step's (out, lse)."""
    swap = lambda lse: jnp.swapaxes(lse, 1, 2)
    out, lse = merge_attention_states([acc[0], part[0].astype(jnp.float32)], [swap(acc[1]), swap(part[1])])
    return out, swap(lse)


def _rotate(tree, axis_name, num_shards):
    """Every device's `tree` sent to the next device along the axis (device r receives r - 1's)."""
    perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _positions(plan, axis_name, q_len, kv_len, t):
    shard = lax.axis_index(axis_name)
    source = (shard - t) % plan.num_shards
    q_pos = shard_positions(q_len, shard, plan.num_shards, plan.layout)
    return shard, source, q_pos, shard_positions(kv_len, source, plan.num_shards, plan.layout)


# ---- the ring, with its own vjp -------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(plan, axis_name, q, k, v, q_ids, kv_ids):
    return _ring_forward(plan, axis_name, q, k, v, q_ids, kv_ids)


def _ring_forward(plan, axis_name, q, k, v, q_ids, kv_ids):
    batch, q_len, heads, dim = q.shape
    acc = (jnp.zeros(q.shape, jnp.float32), jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32))
    held = (k, v, kv_ids)
    for t in range(plan.num_shards):
        if t + 1 < plan.num_shards:  # issued before this step's kernel: the transfer runs under it
            arriving = _rotate(held, axis_name, plan.num_shards)
        shard, source, q_pos, kv_pos = _positions(plan, axis_name, q_len, k.shape[1], t)
        step = (q, held[0], held[1], q_ids, held[2], q_pos, kv_pos)
        acc = _switch(plan, _merge_step, plan.case(shard, source), acc, *step)
        if t + 1 < plan.num_shards:
            held = arriving
    return acc[0].astype(q.dtype), acc[1]


def _ring_fwd(plan, axis_name, q, k, v, q_ids, kv_ids):
    out, lse = _ring_forward(plan, axis_name, q, k, v, q_ids, kv_ids)
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _accumulator_dtype(num_shards: int, dtype):
    """The dtype a ring's gradient accumulates in (`_ring_bwd`): the input's on two devices, else float32."""
    return dtype if num_shards == 2 else jnp.float32


def _ring_bwd(plan, axis_name, residuals, cotangents):
    """Each step's part of the gradient from the backward kernels on the merged (out, lse) and their cotangents:
    with the whole row's lse, a step's probabilities exp(S - lse) are exactly its keys' share of the merged
    softmax, and delta = rowsum(d out * out) - d lse is the whole row's, so no step's forward runs again (as
    ring-flash-attention). dK/dV travel with their K/V, arriving home after the last step's rotation.

    Each gradient sums one part per step, each rounded to its input's dtype by the kernels. On two devices the
    accumulators keep the inputs' dtypes: a bf16 sum of two parts, formed in float32 and rounded once, has the
    bits of a float32 accumulator's rounded result, at half the bytes held and sent. From three devices on they
    are float32, which keeps the running sums unrounded."""
    q, k, v, q_ids, kv_ids, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = (jnp.zeros(x.shape, _accumulator_dtype(plan.num_shards, x.dtype)) for x in (q, k, v))
    held = (k, v, kv_ids)
    for t in range(plan.num_shards):
        if t + 1 < plan.num_shards:
            arriving = _rotate(held, axis_name, plan.num_shards)
        shard, source, q_pos, kv_pos = _positions(plan, axis_name, q.shape[1], k.shape[1], t)
        step = (q, held[0], held[1], q_ids, held[2], q_pos, kv_pos, out, lse, d_out, d_lse)
        dq, dk, dv = _switch(plan, _step_grad, plan.case(shard, source), (dq, dk, dv), *step)
        dk, dv = _rotate((dk, dv), axis_name, plan.num_shards)  # toward the next holder of these K/V (home, last)
        if t + 1 < plan.num_shards:
            held = arriving
    no_grad = lambda ids: None if ids is None else np.zeros(ids.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), no_grad(q_ids), no_grad(kv_ids)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---- all-gather --------------------------------------------------------------------------------------------------


def _all_gather(plan, axis_name, q, k, v, q_ids, kv_ids):
    """K/V (and key ids) gathered in shard order, then one call; positions make the band exact in any layout."""
    gather = lambda x: None if x is None else lax.all_gather(x, axis_name, axis=1, tiled=True)
    k_all, v_all, kv_ids_all = gather(k), gather(v), gather(kv_ids)
    shard = lax.axis_index(axis_name)
    q_pos = shard_positions(q.shape[1], shard, plan.num_shards, plan.layout)
    kv_pos = jnp.concatenate(
        [shard_positions(k.shape[1], s, plan.num_shards, plan.layout) for s in range(plan.num_shards)]
    )
    case = FULL if plan.band.is_full else POSITIONS
    return _step(plan, case, q, k_all, v_all, q_ids, kv_ids_all, q_pos, kv_pos)


# ---- public entry points ------------------------------------------------------------------------------------------


def ring_attention(
    query,
    key,
    value,
    *,
    axis_name,
    is_causal=False,
    local_window_size=None,
    segment_ids=None,
    kv_segment_ids=None,
    layout="contiguous",
    strategy=None,
    scale=None,
    logits_soft_cap=None,
    return_lse=False,
    implementation=None,
    config=None,
    deterministic=True,
):
    """Exact attention of this device's queries against the whole sequence sharded along `axis_name`; call it
    inside `jax.shard_map` (with check_vma=False: Pallas calls carry no varying-axes types).

    Args:
      query: [batch, q_len, heads, head_dim], this device's shard; key, value: [batch, kv_len, kv_heads,
        head_dim], this device's shard (kv_len = q_len when a band (causal, window) applies: self-attention).
      axis_name: the mesh axis the sequence is split along (any number of devices).
      is_causal, local_window_size: as `flash_attention`, on global positions.
      segment_ids, kv_segment_ids: int [batch, q_len] / [batch, kv_len], this shard's ids (packed documents
        across shard borders); kv_segment_ids defaults to segment_ids.
      layout: "contiguous" (shard r holds tokens [r * len, (r + 1) * len)) or "zigzag" (`to_zigzag`: balanced
        causal work; the sequence must have been permuted with it, positions too).
      strategy: "ring", "all_gather", or None: `choose_strategy` on the global length and the head group.
      scale, logits_soft_cap, implementation, config, deterministic: as `flash_attention`.
      return_lse: also return lse [batch, heads, q_len] float32 over the whole sequence.
    Returns:
      out [batch, q_len, heads, head_dim] (and lse), exactly what one device computes for these queries over the
      unsharded sequence; deterministic; differentiable (the ring has its own vjp).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be None or one of {STRATEGIES}, got {strategy!r}")
    num_shards = lax.axis_size(axis_name)
    window = local_window_size
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, window)
    band = masks.Band.of(bool(is_causal), None if window is None else tuple(window))
    q_len, kv_len = query.shape[1], key.shape[1]
    if not band.is_full and q_len != kv_len:
        raise ValueError(f"a causal or windowed ring needs kv_len == q_len per shard, got {kv_len} and {q_len}")
    if layout == "zigzag" and q_len % 2:
        raise ValueError(f"the zig-zag layout holds two chunks per shard: q_len must be even, got {q_len}")
    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("kv_segment_ids needs segment_ids (this shard's query ids) too")
    ids = [None if x is None else jnp.asarray(x, jnp.int32) for x in (segment_ids, kv_segment_ids)]
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, implementation=implementation, config=config,
                   deterministic=deterministic)  # fmt: skip
    plan = _Plan(layout, num_shards, band, tuple(sorted(options.items(), key=lambda item: item[0])))
    strategy = strategy or choose_strategy(kv_len * num_shards, query.shape[2], key.shape[2])
    if strategy == "all_gather" or num_shards == 1:
        out, lse = _all_gather(plan, axis_name, query, key, value, *ids)
    else:
        out, lse = _ring(plan, axis_name, query, key, value, *ids)
    return (out, lse) if return_lse else out


def context_parallel_attention(query, key, value, *, mesh, axis="context", batch_axis=None, **kwargs):
    """`ring_attention` for callers outside `shard_map`: query/key/value [batch, seq, heads, head_dim] (and
    segment ids [batch, seq]) sharded (or to be sharded) with the sequence on mesh axis `axis` and, optionally,
    the batch on `batch_axis`; returns out (and lse) sharded the same way. Works under `jax.jit`."""
    from jax.sharding import PartitionSpec as P

    seq = P(batch_axis, axis, None, None)
    ids = P(batch_axis, axis)
    id_args = {name: kwargs.pop(name) for name in ("segment_ids", "kv_segment_ids") if kwargs.get(name) is not None}
    return_lse = kwargs.get("return_lse", False)
    out_specs = (seq, P(batch_axis, None, axis)) if return_lse else seq

    def local(query, key, value, id_args):
        return ring_attention(query, key, value, axis_name=axis, **id_args, **kwargs)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(seq, seq, seq, {name: ids for name in id_args}), out_specs=out_specs,
        check_vma=False,
    )(query, key, value, id_args)  # fmt: skip
