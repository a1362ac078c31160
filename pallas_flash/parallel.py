"""Context parallelism: exact attention over a sequence sharded along a mesh axis, on our kernels.

Inside `jax.shard_map`, each device holds a contiguous shard of the sequence (or, with the zig-zag layout, two
chunks of it, `to_zigzag`) and calls `ring_attention` on its shard with the axis name. Two strategies:
  * "ring": K/V (with the key segment ids) travel around the axis with `lax.ppermute`; at each step a device
    attends its queries to the K/V it holds, and the partial outputs merge through their LSE
    (`merge_attention_states`). The next step's transfer is issued before this step's kernel, so XLA overlaps
    them. The backward is its own custom_vjp: K/V travel again, and the dK/dV of another device's K/V travel with
    them from the first device that sees them, arriving home after the last step; each step's gradient is the
    backward kernels' on the merged out and lse (no step's forward runs again). Fixed order everywhere: bitwise
    deterministic.
  * "all_gather": K/V gathered once, then one local call (its gradient is reduce-scattered by autodiff). Cheaper
    for short sequences or small K/V (GQA/MQA), where a ring's steps are too short to hide their transfers.
Causal attention with the contiguous layout leaves device r's work unused for the steps that bring later shards
(it computes them and merges them with no weight, as every device runs the same calls); the
zig-zag layout (device r holds chunks r and 2n-1-r of 2n) gives every device the same work at every step: causal
on its own K/V, then two full chunk-against-chunk pieces per step (`_Pairs`), the same calls on every device.
Windows and anything else position-dependent use a mask_mod on global positions.

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

FULL, CAUSAL, POSITIONS = range(3)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of a ring call: layout, the band on global positions, and flash_attention's options."""

    layout: str
    num_shards: int
    band: masks.Band
    options: tuple  # flash_attention keyword arguments, as sorted (name, value) pairs

    def own_case(self) -> int:
        """How a device's queries see its own K/V (the first step): FULL, CAUSAL or POSITIONS; under a full band or
        a window, how they see every shard's (a causal step against another shard runs as `_Pairs`)."""
        if self.band.is_full:
            return FULL
        return CAUSAL if self.band.is_causal else POSITIONS


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


def _options(plan, case, q_ids=None, kv_ids=None, q_pos=None, kv_pos=None):
    """flash_attention's (and attention_backward's) keyword arguments for a FULL, CAUSAL or POSITIONS call."""
    options = dict(plan.options)
    if q_ids is not None:
        options.update(segment_ids=q_ids, kv_segment_ids=kv_ids)
    if case == CAUSAL:
        options["is_causal"] = True
    if case == POSITIONS:
        options["mask_mod"] = _band_mask(plan.band, q_pos, kv_pos)
    return options


@dataclasses.dataclass(frozen=True)
class _Pairs:
    """A causal step against another shard's K/V, as full attention of query rows to key rows in equal-shaped
    pieces, two per example interleaved on the batch axis ([B, 2, ...] as [2B, ...]), the same calls on every
    device whatever the shard pair (no branch on the device index: XLA runs a traced switch on the GPU by
    reading its index back to the host, stalling the queue at every step).

      * contiguous: the local queries against the held K/V whole (one piece); `seen` says whether they are
        visible at all (the source comes earlier), else the piece counts for nothing;
      * zig-zag (local chunks a, b; held chunks c, d): b always sees c whole; a sees c when the source comes
        earlier, else b sees d; nothing else is visible. Two pieces: (b, c) and (a, c) or (b, d).
    """

    seen: jax.Array  # bool: the source shard comes before this one
    zigzag: bool

    def _stack(self, x, fixed: int, axis: int):
        """Chunk `fixed` (0 or 1) of a [B, T, ...] array's two chunks along `axis`, then the second piece's
        chunk (the first when the source comes earlier, else the second), interleaved on the batch axis."""
        if x is None or not self.zigzag:
            return x
        half = x.shape[axis] // 2
        chosen = lax.dynamic_slice_in_dim(x, jnp.where(self.seen, 0, half), half, axis=axis)
        pieces = jnp.stack([lax.slice_in_dim(x, fixed * half, (fixed + 1) * half, axis=axis), chosen], axis=1)
        return pieces.reshape(2 * x.shape[0], *chosen.shape[1:])

    def rows(self, x, axis=1):
        """The pieces' query rows of a local [B, T, ...] array (lse: axis 2): b, then a or b."""
        return self._stack(x, 1, axis)

    def keys(self, x):
        """The pieces' key rows of a held [B, T, ...] array: c, then c or d."""
        return self._stack(x, 0, 1)

    def unstack(self, x):
        """(first piece, second piece) of a stacked result ([2B, ...]); (x, None) for one piece."""
        if not self.zigzag:
            return x, None
        pieces = x.reshape(x.shape[0] // 2, 2, *x.shape[1:])
        return pieces[:, 0], pieces[:, 1]

    def key_rows(self, g):
        """A float32 gradient of the pieces' keys (`keys`) as one of the held [B, T, ...] K/V, zero where the
        layout hides: rows c, d."""
        f32 = lambda x: x.astype(jnp.float32)
        if not self.zigzag:
            return jnp.where(self.seen, f32(g), jnp.zeros(g.shape, jnp.float32))
        g_bc, g_2 = map(f32, self.unstack(g))
        zero = jnp.zeros_like(g_2)
        return jnp.concatenate([g_bc + jnp.where(self.seen, g_2, zero), jnp.where(self.seen, zero, g_2)], axis=1)


def _pairs(plan, shard, source):
    return _Pairs(seen=source < shard, zigzag=plan.layout == "zigzag")


def _sends_pieces(plan) -> bool:
    """Whether the ring sends K/V already cut into the receiver's key pieces (`_Pairs.keys`) and gets their
    dK/dV back uncut: on two devices, where K/V make one hop and the sender knows the receiver's pieces. The cut
    then rides the send buffer's own copy, the receiver attends to what arrives as it is, and the owner lays
    the returning dK/dV over its rows in the add it does anyway (two copies of K/V fewer per step)."""
    return plan.band.is_causal and plan.num_shards == 2


def _receiver_pairs(plan, shard):
    """The `_Pairs` of the device that receives this one's K/V (the next on the axis)."""
    return _pairs(plan, (shard + 1) % plan.num_shards, shard)


def _foreign_forward(plan, pairs, q, k, v, q_ids, kv_ids):
    """(out, lse) parts of a causal step against another shard's K/V, cut into `pairs`' key pieces; for
    `_merge_foreign`."""
    options = _options(plan, FULL, pairs.rows(q_ids), kv_ids)
    return flash_attention(pairs.rows(q), k, v, return_lse=True, **options)


def _merge_foreign(pairs, acc, part):
    """`acc` (out float32, lse) merged with `_foreign_forward`'s part, its pieces laid over the rows they
    cover (lse -inf elsewhere) so that the merge is one elementwise pass over the rows."""
    out, lse = part
    hidden = jnp.float32(-jnp.inf)
    if not pairs.zigzag:
        return _merge(acc, (out, jnp.where(pairs.seen, lse, hidden)))
    (out_bc, out_2), (lse_bc, lse_2) = pairs.unstack(out), pairs.unstack(lse)
    zero_out, no_lse = jnp.zeros_like(out_2), jnp.full_like(lse_2, hidden)
    rows_b = (jnp.concatenate([zero_out, out_bc], axis=1), jnp.concatenate([no_lse, lse_bc], axis=2))
    rows_2 = (
        jnp.where(pairs.seen, jnp.concatenate([out_2, zero_out], axis=1), jnp.concatenate([zero_out, out_2], axis=1)),
        jnp.where(pairs.seen, jnp.concatenate([lse_2, no_lse], axis=2), jnp.concatenate([no_lse, lse_2], axis=2)),
    )
    return _merge(acc, rows_b, rows_2)


def _foreign_backward(plan, pairs, q, k, v, q_ids, kv_ids, lse, d_out, delta):
    """dq (float32, zero where the layout hides) and the pieces' dk, dv of a causal step against another
    shard's K/V cut into `pairs`' key pieces, from the ring's merged lse, d out and delta (`_Pairs.key_rows` lays
    dk, dv over the held rows)."""
    options = _options(plan, FULL, pairs.rows(q_ids), kv_ids)
    lse, d_out, delta = pairs.rows(lse, axis=2), pairs.rows(d_out), pairs.rows(delta, axis=2)
    dq, dk, dv = attention_backward(pairs.rows(q), k, v, None, lse, d_out, delta=delta, **options)
    if not pairs.zigzag:
        return jnp.where(pairs.seen, dq.astype(jnp.float32), jnp.zeros(dq.shape, jnp.float32)), dk, dv
    dq_bc, dq_2 = (x.astype(jnp.float32) for x in pairs.unstack(dq))
    zero = jnp.zeros_like(dq_2)
    dq = jnp.concatenate([jnp.where(pairs.seen, dq_2, zero), dq_bc + jnp.where(pairs.seen, zero, dq_2)], axis=1)
    return dq, dk, dv


def _merge(acc, *parts):
    """Running (out float32 [B, Tq, H, D], lse [B, H, Tq]) merged with parts (out, lse)."""
    swap = lambda lse: jnp.swapaxes(lse, 1, 2)
    outs = [acc[0]] + [part[0].astype(jnp.float32) for part in parts]
    out, lse = merge_attention_states(outs, [swap(acc[1])] + [swap(part[1]) for part in parts])
    return out, swap(lse)


def _add(acc, part):
    """acc + part (float32), formed in float32 and rounded once to acc's dtype."""
    return (acc.astype(jnp.float32) + part).astype(acc.dtype)


def _rotate(tree, axis_name, num_shards):
    """Every device's `tree` sent to the next device along the axis (device r receives r - 1's). Arrays of one
    dtype travel as one buffer: XLA keeps one collective in flight, so K and V sent apart would queue."""
    leaves, treedef = jax.tree.flatten(tree)
    perm = [(i, (i + 1) % num_shards) for i in range(num_shards)]
    arrived = [None] * len(leaves)
    for dtype in dict.fromkeys(x.dtype for x in leaves):
        group = [i for i, x in enumerate(leaves) if x.dtype == dtype]
        flat = lax.ppermute(jnp.concatenate([leaves[i].reshape(-1) for i in group]), axis_name, perm)
        offset = 0
        for i in group:
            arrived[i] = flat[offset : offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return jax.tree.unflatten(treedef, arrived)


def _positions(plan, axis_name, q_len, kv_len, t):
    shard = lax.axis_index(axis_name)
    source = (shard - t) % plan.num_shards
    q_pos = shard_positions(q_len, shard, plan.num_shards, plan.layout)
    return shard, source, q_pos, shard_positions(kv_len, source, plan.num_shards, plan.layout)


# ---- the ring, with its own vjp -------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(plan, axis_name, q, k, v, q_ids, kv_ids):
    return _ring_forward(plan, axis_name, q, k, v, q_ids, kv_ids)


def _sent(plan, axis_name, k, v, kv_ids):
    """What a device sends around the ring of its own K/V (and key ids): cut into the receiver's pieces where
    `_sends_pieces`, else whole."""
    if not _sends_pieces(plan):
        return k, v, kv_ids
    receiver = _receiver_pairs(plan, lax.axis_index(axis_name))
    return tuple(receiver.keys(x) for x in (k, v, kv_ids))


def _cut(plan, pairs, held):
    """The held K/V (and key ids) as `pairs`' key pieces (already cut by the sender where `_sends_pieces`)."""
    return held if _sends_pieces(plan) else tuple(pairs.keys(x) for x in held)


def _ring_forward(plan, axis_name, q, k, v, q_ids, kv_ids):
    q_len, kv_len = q.shape[1], k.shape[1]
    held = _sent(plan, axis_name, k, v, kv_ids)
    acc = None
    for t in range(plan.num_shards):
        if t + 1 < plan.num_shards:  # issued before this step's kernel: the transfer runs under it
            arriving = _rotate(held, axis_name, plan.num_shards)
        shard, source, q_pos, kv_pos = _positions(plan, axis_name, q_len, kv_len, t)
        if t == 0:
            out, lse = flash_attention(q, k, v, return_lse=True, **_options(plan, plan.own_case(), q_ids, kv_ids,
                                                                            q_pos, kv_pos))  # fmt: skip
            acc = (out.astype(jnp.float32), lse)
        elif plan.band.is_causal:
            pairs = _pairs(plan, shard, source)
            k_cut, v_cut, ids_cut = _cut(plan, pairs, held)
            acc = _merge_foreign(pairs, acc, _foreign_forward(plan, pairs, q, k_cut, v_cut, q_ids, ids_cut))
        else:
            options = _options(plan, plan.own_case(), q_ids, held[2], q_pos, kv_pos)
            acc = _merge(acc, flash_attention(q, held[0], held[1], return_lse=True, **options))
        if t + 1 < plan.num_shards:
            held = arriving
    return acc[0].astype(q.dtype), acc[1]


def _ring_fwd(plan, axis_name, q, k, v, q_ids, kv_ids):
    out, lse = _ring_forward(plan, axis_name, q, k, v, q_ids, kv_ids)
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _accumulator_dtype(num_shards: int, dtype):
    """The dtype the dK/dV of other shards' K/V travel in (`_ring_bwd`): the input's on two devices (one
    step's part, sent once), else float32."""
    return dtype if num_shards == 2 else jnp.float32


def _ring_bwd(plan, axis_name, residuals, cotangents):
    """Each step's part of the gradient from the backward kernels on the merged (out, lse) and their cotangents:
    with the whole row's lse, a step's probabilities exp(S - lse) are exactly its keys' share of the merged
    softmax, and delta = rowsum(d out * out) - d lse is the whole row's, so no step's forward runs again (as
    ring-flash-attention).

    A device's own K/V gradient stays home; from the second step on, the dK/dV of the K/V a device holds travel
    with them (from the device that first saw them to each next one, then home: one rotation fewer than
    steps). dQ sums in float32 and is rounded once; the travelling dK/dV are float32 from three devices on and
    in the inputs' dtype on two (one step's part, sent once: a causal step's pieces uncut, `_sends_pieces`),
    then added to the home part in float32."""
    q, k, v, q_ids, kv_ids, out, lse = residuals
    d_out, d_lse = cotangents
    # Every step's backward reads out and d lse only through delta: formed once here for all of them.
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse
    held = _sent(plan, axis_name, k, v, kv_ids)
    travelling, travel_dtype = None, _accumulator_dtype(plan.num_shards, k.dtype)
    for t in range(plan.num_shards):
        if t + 1 < plan.num_shards:
            arriving = _rotate(held, axis_name, plan.num_shards)
        shard, source, q_pos, kv_pos = _positions(plan, axis_name, q.shape[1], k.shape[1], t)
        if t == 0:
            options = _options(plan, plan.own_case(), q_ids, kv_ids, q_pos, kv_pos)
            dq, dk_home, dv_home = attention_backward(q, k, v, None, lse, d_out, delta=delta, **options)
            dq = dq.astype(jnp.float32)
        else:
            if plan.band.is_causal:
                pairs = _pairs(plan, shard, source)
                k_cut, v_cut, ids_cut = _cut(plan, pairs, held)
                parts = _foreign_backward(plan, pairs, q, k_cut, v_cut, q_ids, ids_cut, lse, d_out, delta)
                if not _sends_pieces(plan):  # laid over the held rows here; else by the K/V's owner
                    parts = (parts[0], pairs.key_rows(parts[1]), pairs.key_rows(parts[2]))
            else:
                options = _options(plan, plan.own_case(), q_ids, held[2], q_pos, kv_pos)
                parts = attention_backward(q, held[0], held[1], None, lse, d_out, delta=delta, **options)
                parts = tuple(g.astype(jnp.float32) for g in parts)
            dq = dq + parts[0]
            if travelling is None:
                travelling = tuple(g.astype(travel_dtype) for g in parts[1:])
            else:
                travelling = tuple(_add(acc, g) for acc, g in zip(travelling, parts[1:]))
            travelling = _rotate(travelling, axis_name, plan.num_shards)  # to the next holder; home, last
        if t + 1 < plan.num_shards:
            held = arriving
    dk, dv = dk_home, dv_home
    if travelling is not None:
        if _sends_pieces(plan):
            receiver = _receiver_pairs(plan, lax.axis_index(axis_name))
            away = tuple(receiver.key_rows(g) for g in travelling)
        else:
            away = tuple(g.astype(jnp.float32) for g in travelling)
        dk, dv = (home.astype(jnp.float32) + g for home, g in zip((dk, dv), away))
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
    return flash_attention(q, k_all, v_all, return_lse=True, **_options(plan, case, q_ids, kv_ids_all, q_pos, kv_pos))


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
