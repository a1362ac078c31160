"""Attention of a few new queries over a KV cache (decoding), and the exact merge of partial attention results.

`flash_decode` attends Tq = 1..16 queries per sequence (one decoded token, or a speculative / chunked-prefill
tail) to a contiguous [batch, max_len, kv_heads, head_dim] cache or a paged [num_pages, page_size, kv_heads,
head_dim] cache with a block table, with ragged per-sequence lengths. Positions are aligned to the end of each
sequence: query t of sequence b sits at position lengths[b] - Tq + t and sees keys 0 .. that position (causal,
bottom-right), minus what a left window hides. The result is what `flash_attention` gives for those rows.

Implementations form a registry (`DECODE_REGISTRY`), as `flash_attention`'s do: `implementation=None` runs the
first that serves the call, in this order:
  * "mosaic": the Hopper flash-decoding kernel (`pallas_flash.hopper.decode`: GQA heads packed into one tile,
    split-KV sized to the SMs, a TMA ring over the contiguous or paged cache), bfloat16/float16 at head_dim
    64 or 128 on an sm90 GPU; its per-split partials are merged by `merge_attention_states`.
  * "xla": split-KV in plain JAX, the default off the GPU kernels. The key axis is cut into `num_splits`
    chunks; a `lax.map` computes each chunk's partial output and float32 LSE (a chunk no query can see is
    skipped by `lax.cond`), holding one chunk's [batch, heads, Tq, chunk] logits at a time; paged caches are
    gathered through the block table one chunk at a time. `merge_attention_states` combines the partials.
  * "reference": the dense float32 oracle (`decode_reference`), on request only.
Each is a `DecodeImplementation(name, cannot_serve, defers, run)` where `run(query, key_cache, value_cache,
lengths, block_table, params: DecodeParams) -> (out, lse)` is the contract documented on
`DecodeImplementation`; the checks, option parsing and dispatch here stay as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash import device, masks, reference
from pallas_flash.api import choose
from pallas_flash.hopper import decode as hopper_decode

MAX_QUERY_LEN = 16  # Tq: a decoded token, or a speculative / chunked-prefill tail
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The "xla" implementation's default split: as many keys per split as keep one split's float32 logits
# [batch, heads, Tq, keys] within XLA_SPLIT_LOGITS_BYTES, between XLA_MIN_SPLIT_KEYS and XLA_MAX_SPLIT_KEYS.
XLA_SPLIT_LOGITS_BYTES = 4 << 20
XLA_MIN_SPLIT_KEYS, XLA_MAX_SPLIT_KEYS = 256, 4096


# ---- merging partial results ---------------------------------------------------------------------------------


def merge_attention_states(outputs, lses):
    """The exact attention over the union of disjoint key sets, from each set's output and log-sum-exp.

    Args:
      outputs: [N, ..., D], or a sequence of N arrays [..., D]: the attention output of each of N disjoint
        key sets (e.g. splits of a KV cache, or ring attention's blocks), each normalised over its own keys.
      lses: [N, ...] (or a sequence of N arrays [...]) float: each output's natural-log log-sum-exp of its
        logits, `outputs.shape[:-1]`; -inf where a set has no visible key (its output is then ignored).
    Returns:
      (output [..., D] in the outputs' dtype, lse [...] float32): output = sum_i w_i * outputs_i with
      w_i = exp(lse_i - lse), lse = log(sum_i exp(lse_i)). Computed in float32, shifted by the max LSE; a
      position whose LSEs are all -inf gets output 0 and lse -inf, never NaN. Differentiable in both
      arguments (the gradient is finite where LSEs are -inf).

    `flash_attention` and `flash_decode` return out [B, Tq, H, D] with lse [B, H, Tq]: merge their results
    with `merge_attention_states(outs, jnp.swapaxes(lses, -1, -2))` and swap the merged lse back.
    """
    if isinstance(outputs, (list, tuple)):
        if not outputs:
            raise ValueError("outputs must hold at least one array")
        dtype = jnp.result_type(*outputs)
        outputs = jnp.stack([jnp.asarray(o) for o in outputs])
    else:
        outputs = jnp.asarray(outputs)
        dtype = outputs.dtype
    lses = jnp.stack([jnp.asarray(x) for x in lses]) if isinstance(lses, (list, tuple)) else jnp.asarray(lses)
    if not jnp.issubdtype(dtype, jnp.floating) or not jnp.issubdtype(lses.dtype, jnp.floating):
        raise TypeError(f"outputs and lses must be float arrays, got {dtype} and {lses.dtype}")
    if outputs.ndim < 2 or lses.shape != outputs.shape[:-1]:
        raise ValueError(
            f"lses must have the shape of outputs without its last (head_dim) axis: outputs "
            f"{tuple(outputs.shape)} needs lses {tuple(outputs.shape[:-1])}, got {tuple(lses.shape)}"
        )
    lses = lses.astype(jnp.float32)
    top = lax.stop_gradient(jnp.max(lses, axis=0))  # any shift is exact; the max keeps exp() <= 1
    top = jnp.where(jnp.isneginf(top), 0.0, top)  # all -inf: shift by 0, weights exp(-inf) = 0
    weights = jnp.exp(lses - top)  # [N, ...]
    total = jnp.sum(weights, axis=0)
    empty = total == 0.0
    safe_total = jnp.where(empty, 1.0, total)
    out = jnp.sum((weights / safe_total)[..., None] * outputs.astype(jnp.float32), axis=0)
    lse = jnp.where(empty, -jnp.inf, top + jnp.log(safe_total))
    return out.astype(dtype), lse


# ---- the implementation contract -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """A decode call's static options, checked: scale (a finite float), window_left (keys at
    most this many positions before the query, None: unbounded), logits_soft_cap (float or None), num_splits
    (int >= 1, or None: the implementation's default)."""

    scale: float
    window_left: int | None = None
    logits_soft_cap: float | None = None
    num_splits: int | None = None


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """What an implementation needs to know to say whether it serves a call (static under jit). `page_size`
    is None for a contiguous cache."""

    query: jax.ShapeDtypeStruct
    key_cache: jax.ShapeDtypeStruct
    page_size: int | None
    params: DecodeParams
    value_cache: jax.ShapeDtypeStruct | None = None  # None: shaped like key_cache


@dataclasses.dataclass(frozen=True)
class DecodeImplementation:
    """One entry of `DECODE_REGISTRY`.

    cannot_serve(call) / defers(call): as `api.Implementation` (a reason string, or None).
    run(query, key_cache, value_cache, lengths, block_table, params) -> (out, lse), the contract:
      query [B, Tq, H, D] (float32/bfloat16/float16; 1 <= Tq <= 16; H % Hkv == 0, head h reads kv head
        h // (H // Hkv)); key_cache, value_cache in query's dtype: [B, S, Hkv, D] when block_table is None,
        else pages [num_pages, page_size, Hkv, D] with block_table int32 [B, max_pages] (value_cache's last
        axis is Dv, which may differ from D; sequence b's key at position p lies in page
        block_table[b, p // page_size], row p % page_size); lengths int32 [B]: keys
        held per sequence, its new queries included (traced; may be < Tq or out of range under jit: no
        error, and no out-of-bounds access: clamp page indices);
        params: `DecodeParams`. Query t of sequence b sits at position q = lengths[b] - Tq + t and sees key p
        iff p <= q and (window_left is None or p >= q - window_left). Logits: scale * q.k, then
        cap * tanh(x / cap) with a soft cap.
      Returns out [B, Tq, H, Dv] in query's dtype and lse [B, H, Tq] float32 (natural log); a query that sees
      no key gets zeros and -inf.
    """

    name: str
    cannot_serve: typing.Callable[[DecodeCall], str | None]
    defers: typing.Callable[[DecodeCall], str | None]
    run: typing.Callable


# ---- shared pieces ---------------------------------------------------------------------------------------------


def _query_positions(lengths, q_len):
    """int32 [B, Tq]: the absolute position of each new query."""
    return lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]


def _visible(q_pos, k_pos, window_left):
    """bool [B, 1, 1, Tq, K] from q_pos [B, Tq] and k_pos [K] or [B, K]."""
    q = q_pos[:, None, None, :, None]
    k = k_pos[:, None, None, None, :] if k_pos.ndim == 2 else k_pos[None, None, None, None, :]
    seen = k <= q
    if window_left is not None:
        seen = jnp.logical_and(seen, k >= q - window_left)
    return seen


def _einsum(spec, a, b):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _gather_pages(cache, page_ids):
    """cache [P, page, Hkv, D], page_ids [B, n] -> [B, n * page, Hkv, D] (indices clamped into range)."""
    pages = jnp.take(cache, page_ids, axis=0, mode="clip")
    return pages.reshape(page_ids.shape[0], -1, *cache.shape[2:])


def decode_reference(query, key_cache, value_cache, lengths, block_table, params: DecodeParams):
    """The dense float32 oracle: the whole (gathered) cache as one [B, S, Hkv, D] sequence, a mask of what
    each query sees, and `reference.attention_reference`. Same contract as `DecodeImplementation.run`."""
    if block_table is not None:
        key_cache = _gather_pages(key_cache, block_table)
        value_cache = _gather_pages(value_cache, block_table)
    q_len, kv_len = query.shape[1], key_cache.shape[1]
    seen = _visible(_query_positions(lengths, q_len), jnp.arange(kv_len), params.window_left)[:, 0]
    return reference.attention_reference(
        query, key_cache, value_cache, scale=params.scale, mask=seen, logits_soft_cap=params.logits_soft_cap
    )


def xla_default_num_splits(batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """The "xla" implementation's num_splits when none is given: ceil(kv_len / keys) with keys per split
    such that a split's float32 logits [batch, heads, q_len, keys] stay within XLA_SPLIT_LOGITS_BYTES,
    clamped to [XLA_MIN_SPLIT_KEYS, XLA_MAX_SPLIT_KEYS]."""
    keys = XLA_SPLIT_LOGITS_BYTES // (4 * batch * heads * q_len)
    keys = min(max(keys, XLA_MIN_SPLIT_KEYS), XLA_MAX_SPLIT_KEYS)
    return max(1, -(-kv_len // keys))


def _partial(q, k, v, q_pos, k_pos, lo, params: DecodeParams):
    """One split: q [B, Tq, Hkv, G, D]; k, v [B, C, Hkv, D] at positions k_pos [C] (keys before `lo` belong
    to an earlier split and are hidden). Returns out [B, Hkv, G, Tq, Dv] float32, lse [B, Hkv, G, Tq]."""
    s = _einsum("bqhgd,bkhd->bhgqk", q, k) * params.scale
    if params.logits_soft_cap is not None:
        s = masks.soft_cap(s, params.logits_soft_cap)
    seen = jnp.logical_and(_visible(q_pos, k_pos, params.window_left), (k_pos >= lo)[None, None, None, None, :])
    s = jnp.where(seen, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    shift = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - shift[..., None])
    total = jnp.sum(p, axis=-1)
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    pv = _einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v)
    return pv / safe[..., None], jnp.where(empty, -jnp.inf, shift + jnp.log(safe))


def decode_xla(query, key_cache, value_cache, lengths, block_table, params: DecodeParams):
    """Split-KV decode attention in plain JAX (the "xla" implementation); contract of
    `DecodeImplementation.run`. Splits of a paged cache are whole pages; `num_splits` is an upper bound."""
    batch, q_len, heads, dim = query.shape
    kv_heads, dim_v = key_cache.shape[2], value_cache.shape[3]
    paged = block_table is not None
    page = key_cache.shape[1] if paged else 1
    units = block_table.shape[1] if paged else key_cache.shape[1]  # pages, or keys
    kv_len = units * page
    splits = params.num_splits or xla_default_num_splits(batch, heads, q_len, kv_len)
    per_split = -(-units // min(splits, units))  # pages or keys per split
    splits = -(-units // per_split)
    chunk = per_split * page
    if paged and splits * per_split != units:  # pad the table (ints), never the cache: padded pages are hidden
        block_table = jnp.pad(block_table, ((0, 0), (0, splits * per_split - units)))
    q = query.reshape(batch, q_len, kv_heads, heads // kv_heads, dim)
    q_pos = _query_positions(lengths, q_len)
    # Per sequence, the keys some query sees: [first, lengths).
    first = jnp.zeros_like(lengths) if params.window_left is None else q_pos[:, 0] - params.window_left

    def split(i):
        lo = i * chunk
        if paged:
            ids = lax.dynamic_slice_in_dim(block_table, i * per_split, per_split, axis=1)
            k, v = _gather_pages(key_cache, ids), _gather_pages(value_cache, ids)
            start = lo
        else:  # the last split may overhang the cache: slide it back and hide the keys before `lo`
            start = jnp.minimum(lo, kv_len - chunk)
            k = lax.dynamic_slice_in_dim(key_cache, start, chunk, axis=1)
            v = lax.dynamic_slice_in_dim(value_cache, start, chunk, axis=1)
        k_pos = start + jnp.arange(chunk, dtype=jnp.int32)
        return _partial(q, k, v, q_pos, k_pos, lo, params)

    def skipped(i):
        shape = (batch, kv_heads, heads // kv_heads, q_len)
        return jnp.zeros((*shape, dim_v), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32)

    def run_split(i):
        lo = i * chunk
        needed = jnp.any(jnp.logical_and(lo < lengths, lo + chunk > first))
        return lax.cond(needed, split, skipped, i)

    if splits == 1:
        out, lse = split(jnp.int32(0))
    else:
        outs, lses = lax.map(run_split, jnp.arange(splits, dtype=jnp.int32))
        out, lse = merge_attention_states(outs, lses)
    out = jnp.moveaxis(out.reshape(batch, heads, q_len, dim_v), 1, 2).astype(query.dtype)
    return out, lse.reshape(batch, heads, q_len)


def _hopper_cannot_serve(call: DecodeCall) -> str | None:
    if not device.on_hopper_gpu():
        return "no Hopper (sm90) GPU: the Mosaic GPU decode kernel uses its TMA and wgmma"
    head_dim = call.query.shape[3]
    head_dim_v = head_dim if call.value_cache is None else call.value_cache.shape[3]
    if head_dim_v != head_dim:  # the kernel holds one head_dim for its K and V tiles
        return (
            "the Mosaic GPU decode kernel needs value_cache's head_dim equal to query's and key_cache's: "
            f"head_dims are {head_dim} (query, key_cache) and {head_dim_v} (value_cache)"
        )
    return hopper_decode.unsupported_reason(call.query.dtype, call.query.shape[3], call.page_size)


def decode_hopper(query, key_cache, value_cache, lengths, block_table, params: DecodeParams, *, interpret=None):
    """The Hopper flash-decoding kernel (the "mosaic" implementation, `hopper.decode`): its per-split partial
    results merged through their LSEs; contract of `DecodeImplementation.run`. `interpret`: as
    `hopper_decode_partials`' (the Mosaic GPU interpreter on CPU, for tests)."""
    outs, lses = hopper_decode.hopper_decode_partials(
        query,
        key_cache,
        value_cache,
        lengths,
        block_table,
        scale=params.scale,
        window_left=params.window_left,
        logits_soft_cap=params.logits_soft_cap,
        num_splits=params.num_splits,
        interpret=interpret,
    )
    if outs.shape[0] == 1:  # one split: nothing to merge (and no merge kernels in a decode step)
        out, lse = outs[0], lses[0]
    else:
        out, lse = merge_attention_states(outs, lses)
    return out.astype(query.dtype), jnp.swapaxes(lse, 1, 2)


DECODE_REGISTRY = (
    DecodeImplementation("mosaic", _hopper_cannot_serve, lambda call: None, decode_hopper),
    DecodeImplementation("xla", lambda call: None, lambda call: None, decode_xla),
    DecodeImplementation(
        "reference",
        lambda call: None,
        lambda call: "the dense reference holds Tq x cache logits: only on request",
        decode_reference,
    ),
)
DECODE_IMPLEMENTATIONS = tuple(impl.name for impl in DECODE_REGISTRY)

# ---- checks --------------------------------------------------------------------------------------------------


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_array(name, x, rank, layout):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def _check_shapes(query, key_cache, value_cache, lengths, block_table):
    """Shapes and dtypes (static: checked under jit too). Returns lengths and block_table as int32 arrays."""
    _check_array("query", query, 4, "[batch, q_len, heads, head_dim]")
    cache_layout = (
        "[num_pages, page_size, kv_heads, head_dim]"
        if block_table is not None
        else "[batch, max_len, kv_heads, head_dim]"
    )
    _check_array("key_cache", key_cache, 4, cache_layout)
    _check_array("value_cache", value_cache, 4, cache_layout)
    if not any(query.dtype == d for d in SUPPORTED_DTYPES):
        raise TypeError(f"query has dtype {query.dtype}; allowed: float32, bfloat16, float16")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != query.dtype:
            raise TypeError(
                f"{name} has dtype {cache.dtype} but query has {query.dtype}; they must match "
                "(cast the query, or store the cache in the query's dtype)"
            )
    batch, q_len, heads, dim = query.shape
    if not 1 <= q_len <= MAX_QUERY_LEN:
        raise ValueError(
            f"query has q_len {q_len} (axis 1); flash_decode serves 1 to {MAX_QUERY_LEN} queries per "
            "sequence: use flash_attention for longer (prefill) chunks"
        )
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(
            f"key_cache and value_cache must have the same shape but for head_dim, got {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != dim:
        raise ValueError(f"key_cache has head_dim {key_cache.shape[3]}; query has head_dim {dim}")
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"key_cache has {kv_heads} kv heads; query's {heads} heads must be a positive multiple")
    if min(key_cache.shape[:2]) < 1 or batch < 1:
        raise ValueError(f"empty arrays: query {tuple(query.shape)}, key_cache {tuple(key_cache.shape)}")
    lengths = lengths if hasattr(lengths, "dtype") else np.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must be an integer array [batch], got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"lengths must have shape ({batch},) (one length per sequence), got {tuple(lengths.shape)}")
    if block_table is None:
        if key_cache.shape[0] != batch:
            raise ValueError(
                f"key_cache has batch {key_cache.shape[0]}; query has batch {batch} (a paged cache needs block_table)"
            )
        return lengths, None
    block_table = block_table if hasattr(block_table, "dtype") else np.asarray(block_table)
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise TypeError(f"block_table must be an integer array [batch, max_pages], got dtype {block_table.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape ({batch}, max_pages >= 1), got {tuple(block_table.shape)}")
    return lengths, block_table


def _check_values(lengths, block_table, q_len, capacity, num_pages, page_size):
    """Bounds of concrete lengths and block tables (skipped for traced values: under jit nothing is checked)."""
    if not _is_traced(lengths):
        values = np.asarray(lengths)
        bad = np.flatnonzero((values < q_len) | (values > capacity))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"lengths[{b}] = {int(values[b])}: each length must be in [q_len, cache capacity] = "
                f"[{q_len}, {capacity}] (the keys held, the {q_len} new queries' own included)"
            )
        if block_table is not None and not _is_traced(block_table):
            table = np.asarray(block_table)
            used = np.arange(table.shape[1])[None, :] < -(-values[:, None] // page_size)
            bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
            if bad.size:
                b, i = map(int, bad[0])
                raise ValueError(
                    f"block_table[{b}, {i}] = {int(table[b, i])} is outside the cache's pages "
                    f"[0, {num_pages}) (it holds keys of sequence {b}, whose length is {int(values[b])})"
                )


def _window_left(local_window_size):
    if local_window_size is None:
        return None
    if isinstance(local_window_size, list):
        local_window_size = tuple(local_window_size)
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
        left, right = int(local_window_size), 0
    elif isinstance(local_window_size, tuple) and len(local_window_size) == 2:
        left, right = local_window_size
    else:
        left, right = None, -1
    ok = (left is None or (isinstance(left, (int, np.integer)) and not isinstance(left, bool) and left >= 0)) and (
        right is None or (isinstance(right, (int, np.integer)) and not isinstance(right, bool) and right == 0)
    )
    if not ok:
        raise ValueError(
            "local_window_size must be None, an int w >= 0 (keys at most w positions back) or a tuple "
            f"(left >= 0 or None, right = 0 or None): decoding is causal; got {local_window_size!r}"
        )
    return None if left is None else int(left)


def _static_float(name, x, *, positive):
    if x is None:
        return None
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python float (it selects the computation), got a traced value")
    if isinstance(x, (bool, np.bool_)) or not (
        isinstance(x, (int, float, np.number)) or (isinstance(x, (np.ndarray, jax.Array)) and x.shape == ())
    ):
        raise TypeError(f"{name} must be a float, got {x!r}")
    x = float(x)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{name} must be a finite float{' > 0' if positive else ''}, got {x!r}")
    return x


# ---- the entry point -----------------------------------------------------------------------------------------


def flash_decode(
    query,
    key_cache,
    value_cache,
    *,
    lengths,
    block_table=None,
    scale=None,
    local_window_size=None,
    logits_soft_cap=None,
    return_lse=False,
    num_splits=None,
    implementation=None,
):
    """Attention of Tq (1 to 16) new queries per sequence over a KV cache, exact, with ragged lengths.

    Args:
      query: [batch, Tq, heads, head_dim], float32/bfloat16/float16, 1 <= Tq <= 16: the newest Tq tokens of
        each sequence (one decoded token, or a speculative / chunked-prefill tail), whose keys and values are
        already in the cache.
      key_cache, value_cache: in query's dtype; contiguous [batch, max_len, kv_heads, head_dim], or paged
        [num_pages, page_size, kv_heads, head_dim] with `block_table`; value_cache's head_dim (head_dim_v) may
        differ (DeepSeek's MLA: 192 and 128; served by "xla" and "reference"). heads % kv_heads == 0 (MHA, GQA, MQA):
        query head h reads kv head h // (heads // kv_heads).
      lengths: int [batch]: keys held per sequence, its Tq new ones included. Query t of sequence b sits at
        position lengths[b] - Tq + t and sees keys 0 .. that position (causal, aligned to the end). Concrete
        lengths must lie in [Tq, capacity] (capacity: max_len, or max_pages * page_size), else ValueError.
        Traced lengths (under jit) are not checked: a length below Tq leaves its earliest queries nothing to
        see (zeros, lse -inf); a length beyond the capacity gives meaningless values (nothing is read out of
        bounds).
      block_table: int [batch, max_pages] for a paged cache: sequence b's key at position p lies in page
        block_table[b, p // page_size], row p % page_size. Concrete tables are checked for the pages that
        hold keys (the first ceil(lengths[b] / page_size)); entries after those are never used and may hold
        anything (e.g. -1). Traced tables are not checked; indices are clamped into range.
      scale: softmax scale; default 1 / sqrt(head_dim). A scalar JAX array (traced) is folded into the query.
      local_window_size: int w or (w, 0): a query at position q sees keys q - w .. q. None: unbounded.
      logits_soft_cap: float c > 0 or None: logits = c * tanh(scale * q.k / c), as in `flash_attention`.
      return_lse: also return the log-sum-exp of the logits, [batch, heads, Tq] float32, natural log (-inf for
        a query that sees no key). Partial results over disjoint caches merge through it exactly
        (`merge_attention_states`).
      num_splits: split-KV parallelism (cache chunks computed apart, then merged); None: the implementation's
        default ("xla": `xla_default_num_splits`: splits of up to 4096 keys, fewer where batch * heads * Tq
        is large, at least 256; "mosaic": `hopper.decode.default_num_splits`, enough CTAs to fill the SMs).
        An upper bound: paged splits are whole pages, the kernel's whole key blocks.
      implementation: None (the first of `DECODE_IMPLEMENTATIONS` that serves the call), "mosaic" (the Hopper
        kernel: bfloat16/float16, head_dim 64 or 128, on an sm90 GPU), "xla" or "reference" (dense float32).
    Returns:
      out [batch, Tq, heads, head_dim_v] in query's dtype (a query that sees no key gets zeros), and lse if
      `return_lse`. The "xla" and "reference" paths differentiate by JAX autodiff (no custom backward); the
      "mosaic" kernel has no gradient (it serves inference).

    Options other than scale must be static under `jax.jit`; lengths and block_table may be traced.
    """
    lengths, block_table = _check_shapes(query, key_cache, value_cache, lengths, block_table)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if implementation is not None and implementation not in DECODE_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {DECODE_IMPLEMENTATIONS}, got {implementation!r}")
    window_left = _window_left(local_window_size)
    soft_cap = _static_float("logits_soft_cap", logits_soft_cap, positive=True)
    scale_value = None
    if isinstance(scale, jax.Array) and not isinstance(scale, jax.core.Tracer) and scale.shape == ():
        scale = float(scale)
    if isinstance(scale, jax.Array):
        if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise TypeError(f"scale must be a float or a float scalar array, got {scale!r}")
        scale, scale_value = None, scale
    else:
        scale = _static_float("scale", scale, positive=False)
    batch, q_len, heads, dim = query.shape
    paged = block_table is not None
    page_size = key_cache.shape[1] if paged else None
    capacity = block_table.shape[1] * page_size if paged else key_cache.shape[1]
    _check_values(lengths, block_table, q_len, capacity, key_cache.shape[0], page_size)
    params = DecodeParams(
        scale=1.0 if scale_value is not None else (1.0 / math.sqrt(dim) if scale is None else scale),
        window_left=window_left,
        logits_soft_cap=soft_cap,
        num_splits=None if num_splits is None else int(num_splits),
    )
    call = DecodeCall(
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
        page_size,
        params,
        jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype),
    )
    impl = choose(DECODE_REGISTRY, implementation, call, what="flash_decode ")
    out, lse = _decode(
        query,
        key_cache,
        value_cache,
        jnp.asarray(lengths, jnp.int32),
        None if block_table is None else jnp.asarray(block_table, jnp.int32),
        scale_value,
        impl=impl.name,
        params=params,
    )
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("impl", "params"))
def _decode(query, key_cache, value_cache, lengths, block_table, scale_value, *, impl, params):
    if scale_value is not None:  # a traced scale: folded into the query, the implementations scale by 1
        query = (query.astype(jnp.float32) * scale_value.astype(jnp.float32)).astype(query.dtype)
    run = {entry.name: entry.run for entry in DECODE_REGISTRY}[impl]
    return run(query, key_cache, value_cache, lengths, block_table, params)
