"""The public entry point: argument checks at the boundary, then dispatch over a registry of implementations.

Each implementation declares what it cannot serve (a reason, or None) and what it would rather leave to another
(a reason to skip it when `implementation=None`); dispatch takes the first that may run and logs why the ones
before it did not."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import typing

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import device, masks, reference, xla_chunked
from pallas_flash import mods as mods_lib
from pallas_flash.block_sparse import BlockMask
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import vjp as hopper
from pallas_flash.portable import vjp as portable

logger = logging.getLogger("pallas_flash")

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# flash_attention's arguments that pick the computation rather than feed it: static under jit.
STATIC_ARGNAMES = (
    "is_causal",
    "local_window_size",
    "block_mask",
    "logits_soft_cap",
    "dropout_rate",
    "broadcast_dropout",
    "return_lse",
    "implementation",
    "config",
    "deterministic",
)

_logged: set = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.debug(message)


def _score_tile_bytes(mods: masks.ScoreMods, mod_arrays: masks.ModArrays) -> int:
    """Bytes per logit of the bias/mask tiles the portable kernels stream beside K and V: a bias or mask
    that spans both queries and keys is read as a [block_q, block_kv] tile per step (one that spans only
    one of them is a vector: negligible)."""
    tile_bytes = 0
    if mods.bias_dims is not None and mods.bias_dims[2] and mods.bias_dims[3]:
        tile_bytes += jnp.dtype(mod_arrays.bias.dtype).itemsize
    if mods.mask_dims is not None and mods.mask_dims[2] and mods.mask_dims[3]:
        tile_bytes += 1  # bool, one byte per element
    return tile_bytes


def _check_inputs(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
        if not any(x.dtype == d for d in SUPPORTED_DTYPES):
            raise TypeError(f"{name} has dtype {x.dtype}; allowed: float32, bfloat16, float16")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    batch, q_len, heads, head_dim = query.shape
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"key and value must have the same shape but for head_dim, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[0] != batch:
        raise ValueError(f"key has batch {key.shape[0]}; query has batch {batch}")
    if key.shape[3] != head_dim:
        raise ValueError(f"key has head_dim {key.shape[3]}; query has head_dim {head_dim}")
    if q_len < 1 or key.shape[1] < 1:
        raise ValueError(f"sequence lengths must be >= 1, got q_len={q_len}, kv_len={key.shape[1]}")
    if heads < 1 or key.shape[2] < 1:
        raise ValueError(f"head counts must be >= 1, got query heads={heads}, key heads={key.shape[2]}")
    if heads % key.shape[2] != 0:
        raise ValueError(f"key has {key.shape[2]} heads; query's {heads} heads must be a multiple of it")
    for name, dim in (("head_dim", head_dim), ("value's head_dim", value.shape[3])):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} is {dim}; allowed: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")


@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation needs to know to say whether it serves a call (all static under jit)."""

    query: jax.ShapeDtypeStruct
    key: jax.ShapeDtypeStruct
    band: masks.Band
    config: KernelConfig
    features: tuple[str, ...]  # the score modifiers and block mask the call uses
    mods: masks.ScoreMods = masks.ScoreMods()
    value: jax.ShapeDtypeStruct | None = None  # None: shaped like key (one head_dim for query, key and value)
    block_mask: BlockMask | None = None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One entry of the registry. `cannot_serve(call)`: why it cannot compute this call (None if it can);
    forcing it then raises. `defers(call)`: why `implementation=None` should pick a later entry although this
    one could run (None if it should not)."""

    name: str
    cannot_serve: typing.Callable[[Call], str | None]
    defers: typing.Callable[[Call], str | None]


def _mosaic_cannot_serve(call: Call) -> str | None:
    unserved = tuple(f for f in call.features if f not in _HOPPER_KERNEL_FEATURES + _HOPPER_PROGRAMS)
    return hopper.unsupported_reason(
        call.query,
        call.key,
        band=call.band,
        unserved=unserved,
        config=call.config,
        mods=_hopper_programs(call.mods),
        value=call.value,
        block_mask=call.block_mask,
    )


# Modifiers the Hopper kernels take as programs or dense tiles (`_hopper_programs`), and those they run themselves.
_HOPPER_PROGRAMS = ("logits_soft_cap", "alibi_slopes", "bias", "mask", "score_mod", "mask_mod")
_HOPPER_KERNEL_FEATURES = ("dropout", "block_mask")


def _spans_both(dims) -> bool:
    """Whether a bias or mask spans both queries and keys: a gather by both positions, which no program can
    carry; the Hopper kernels stream it tile by tile instead."""
    return dims is not None and dims[2] and dims[3]


def _hopper_programs(mods: masks.ScoreMods, mod_arrays: masks.ModArrays | None = None):
    """The score modifiers as the Hopper kernels take them: soft cap, a bias over queries or keys (not both),
    ALiBi and the score_mod folded into one score program (in the order `masks` defines), a mask over queries or
    keys ANDed into the mask program. A bias or mask over both stays (the kernels read it tile by tile), and with
    such a bias so does the soft cap, which the kernels then apply before adding it (the score program holds
    what follows the bias). Returns ScoreMods, and with `mod_arrays` also the ModArrays carrying the folded
    programs' closed-over arrays (without it, stand-ins of the arrays trace the same structure)."""
    bias_dims = mods.bias_dims if not _spans_both(mods.bias_dims) else None
    mask_dims = mods.mask_dims if not _spans_both(mods.mask_dims) else None
    cap = None if _spans_both(mods.bias_dims) else mods.soft_cap  # folded into the score program
    folds_score = cap is not None or mods.alibi or bias_dims is not None
    if not folds_score and mask_dims is None:
        return mods if mod_arrays is None else (mods, mod_arrays)

    def stand_in(program):
        return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in program.jaxpr.invars[: program.num_consts]]

    if mod_arrays is None:
        arrays = masks.ModArrays(
            bias=jnp.zeros((1, 1, 1, 1), jnp.float32),
            mask=jnp.ones((1, 1, 1, 1), bool),
            alibi_slopes=jnp.zeros((1, 1), jnp.float32),
            score_consts=() if mods.score_mod is None else stand_in(mods.score_mod),
            mask_consts=() if mods.mask_mod is None else stand_in(mods.mask_mod),
        )
    else:
        arrays = mod_arrays

    def at(x, dims, b, h, q, k):  # x [B|1, H|1, Tq|1, Tk|1]: the element for (b, h, q, k)
        return x[tuple(i if full else 0 for i, full in zip((b, h, q, k), dims))]

    folded, new_arrays = mods, arrays
    if folds_score:
        user, bias, slopes = mods.score_mod, arrays.bias, arrays.alibi_slopes

        def score_mod(s, b, h, q, k):
            if cap is not None:  # a multiply, not a divide: the kernels' division is a precise (slow) one
                s = cap * jnp.tanh(s * (1.0 / cap))
            if bias_dims is not None:
                s = s + at(bias, bias_dims, b, h, q, k).astype(jnp.float32)
            if mods.alibi:  # slopes [batch, heads], constants (the API stops their gradient)
                s = s - jax.lax.stop_gradient(slopes)[b, h] * jnp.abs(k - q).astype(jnp.float32)
            return s if user is None else user(arrays.score_consts, s, b, h, q, k)

        program, consts = mods_lib.trace(score_mod, "score")
        folded = dataclasses.replace(
            folded,
            soft_cap=None if cap is not None else mods.soft_cap,
            alibi=False,
            score_mod=program,
            bias_dims=None if bias_dims is not None else mods.bias_dims,
        )
        new_arrays = new_arrays._replace(
            alibi_slopes=None, score_consts=consts, bias=None if bias_dims is not None else new_arrays.bias
        )
    if mask_dims is not None:
        user, mask = mods.mask_mod, arrays.mask

        def mask_mod(b, h, q, k):
            seen = at(mask, mask_dims, b, h, q, k)
            return seen if user is None else seen & user(arrays.mask_consts, b, h, q, k)

        program, consts = mods_lib.trace(mask_mod, "mask")
        folded = dataclasses.replace(folded, mask_dims=None, mask_mod=program)
        new_arrays = new_arrays._replace(mask=None, mask_consts=consts)
    return folded if mod_arrays is None else (folded, new_arrays)


def _never(call: Call) -> None:
    return None


def _portable_cannot_serve(call: Call) -> str | None:
    return portable.unsupported_reason(call.mods)


# In order of preference: the first entry that serves a call and does not defer it runs.
REGISTRY = (
    Implementation("mosaic", _mosaic_cannot_serve, _never),
    Implementation(
        "pallas",
        _portable_cannot_serve,
        lambda call: (
            None
            if device.on_nvidia_gpu()
            else ("no NVIDIA GPU: its kernels would run in Pallas interpret mode (a test path)")
        ),
    ),
    Implementation("xla_chunked", _never, _never),
    Implementation("xla", _never, lambda call: "the dense reference holds q_len x kv_len logits: only on request"),
)
IMPLEMENTATIONS = tuple(impl.name for impl in REGISTRY)


def choose(registry, implementation: str | None, call, *, what: str = ""):
    """The entry of `registry` (ordered by preference, each with `name`, `cannot_serve` and `defers`) that runs
    `call`: with implementation=None the first that serves it and does not defer it, logged with the reason each
    preferred one was passed over; else the named entry, or a ValueError saying why it cannot serve. `what`
    prefixes the messages with the entry point's name ("" for flash_attention)."""
    if implementation is None:
        passed = []
        for impl in registry:
            reason = impl.cannot_serve(call) or impl.defers(call)
            if reason is None:
                why = "; ".join(f"not {name!r}: {why}" for name, why in passed) or "the first choice"
                _log_once(
                    f"pallas_flash: {what}implementation=None ran {impl.name!r} on backend "
                    f"{jax.default_backend()!r} ({why})"
                )
                return impl
            passed.append((impl.name, reason))
        raise AssertionError("a registry ends with implementations that serve every call")
    chosen = {impl.name: impl for impl in registry}.get(implementation)
    if chosen is None:
        names = tuple(impl.name for impl in registry)
        raise ValueError(f"implementation must be None or one of {names}, got {implementation!r}")
    reason = chosen.cannot_serve(call)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot serve this {what}call: {reason}")
    return chosen


def dispatch(implementation: str | None, call: Call) -> str:
    """The name of the implementation that runs `call` (`choose` over `REGISTRY`)."""
    chosen = choose(REGISTRY, implementation, call)
    reason = chosen.defers(call) if implementation == "pallas" else None
    if reason is not None:  # forced onto a CPU: interpret mode, said once
        _log_once(f"pallas_flash: implementation='pallas' runs although {reason}")
    return chosen.name


def _check_window(local_window_size):
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    ok = (
        isinstance(local_window_size, tuple)
        and len(local_window_size) == 2
        and all(
            side is None or (isinstance(side, int) and not isinstance(side, bool) and side >= 0)
            for side in local_window_size
        )
    )
    if not ok:
        raise ValueError(
            "local_window_size must be None, an int >= 0, or a tuple (left, right) of ints >= 0 "
            f"(or None for an unbounded side), got {local_window_size!r}"
        )
    return local_window_size


def _fold_band_mod(mask_mod, is_causal, local_window_size):
    """(mask_mod, is_causal, local_window_size) with a band mask_mod (`mods.causal`, `mods.sliding_window` and
    their `and_masks`: a `band` attribute) folded into the built-in band, intersected with the one given: the
    same keys, but the kernels visit only the band's blocks with no mask program and size their tiles by it."""
    band = getattr(mask_mod, "band", None)
    if band is None:
        return mask_mod, is_causal, local_window_size
    band = masks.Band.of(is_causal, _check_window(local_window_size)) & band
    if band.is_causal:
        return None, True, None
    return None, False, None if band.is_full else (band.left, band.right)


def _check_int_array(name, x, shape):
    if x is None:
        return None
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    return x.astype(jnp.int32)


def _segments(query, key, segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths):
    """Segment ids and lengths folded into one pair of int32 [batch, len] segment-id arrays, or (None, None)."""
    batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
    segment_ids = _check_int_array("segment_ids", segment_ids, (batch, q_len))
    if kv_segment_ids is None and segment_ids is not None:
        if kv_len != q_len:
            raise ValueError(f"kv_segment_ids is required when q_len ({q_len}) != kv_len ({kv_len})")
        kv_segment_ids = segment_ids
    kv_segment_ids = _check_int_array("kv_segment_ids", kv_segment_ids, (batch, kv_len))
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("kv_segment_ids needs segment_ids (the query's segment ids) too")
    q_lengths = _check_int_array("query_seq_lengths", query_seq_lengths, (batch,))
    kv_lengths = _check_int_array("key_value_seq_lengths", key_value_seq_lengths, (batch,))
    if segment_ids is None and q_lengths is None and kv_lengths is None:
        return None, None
    q_ids = masks.segments_from_lengths(segment_ids, q_lengths, q_len, masks.QUERY_PADDING_ID)
    kv_ids = masks.segments_from_lengths(kv_segment_ids, kv_lengths, kv_len, masks.KEY_PADDING_ID)
    # Lengths on one side only: the other side's ids are all 0 (one segment).
    q_ids = jnp.zeros((batch, q_len), jnp.int32) if q_ids is None else q_ids
    kv_ids = jnp.zeros((batch, kv_len), jnp.int32) if kv_ids is None else kv_ids
    return q_ids, kv_ids


def _check_block_mask(block_mask, query, key):
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a pallas_flash.BlockMask, got {type(block_mask).__name__}")
    block_mask.check(query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    # Every block True constrains nothing: the dense kernels (band loops, their own tile sizes) run instead.
    return None if block_mask.mask.all() else block_mask


def _broadcast_dims(name, x, full_shape):
    """Which of [batch, heads, q_len, kv_len] an array broadcastable to `full_shape` spans, and the array
    as rank 4 with each dim 1 or full (NumPy broadcasting: missing leading dims are 1)."""
    if x.ndim > 4:
        raise ValueError(
            f"{name} must have rank <= 4, broadcastable to [batch, heads, q_len, kv_len] = "
            f"{full_shape}, got shape {tuple(x.shape)}"
        )
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    if any(n not in (1, full) for n, full in zip(x.shape, full_shape)):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; it must broadcast to [batch, heads, q_len, kv_len] "
            f"= {full_shape} (each dim 1 or full)"
        )
    return tuple(n != 1 or full == 1 for n, full in zip(x.shape, full_shape)), x


def _score_mods(query, key, bias, mask, alibi_slopes, logits_soft_cap, dropout_rate, dropout_rng, broadcast_dropout):
    """Checked score modifiers: (masks.ScoreMods, masks.ModArrays)."""
    batch, q_len, heads, _ = query.shape
    full_shape = (batch, heads, q_len, key.shape[1])
    bias_dims = mask_dims = None
    if bias is not None:
        if not hasattr(bias, "dtype") or not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array, got {getattr(bias, 'dtype', type(bias).__name__)}")
        bias_dims, bias = _broadcast_dims("bias", bias, full_shape)
    if mask is not None:
        if not hasattr(mask, "dtype") or mask.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be a bool array (True = attend), got {getattr(mask, 'dtype', type(mask).__name__)}"
            )
        mask_dims, mask = _broadcast_dims("mask", mask, full_shape)
    if alibi_slopes is not None:
        if not hasattr(alibi_slopes, "dtype") or not jnp.issubdtype(alibi_slopes.dtype, jnp.floating):
            raise TypeError(
                f"alibi_slopes must be a float array, got {getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}"
            )
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {tuple(alibi_slopes.shape)}"
            )
        # Slopes are constants of the model: no gradient flows into them.
        alibi_slopes = jnp.broadcast_to(jax.lax.stop_gradient(alibi_slopes).astype(jnp.float32), (batch, heads))
    if logits_soft_cap is not None:
        if (
            not isinstance(logits_soft_cap, (int, float))
            or isinstance(logits_soft_cap, bool)
            or not math.isfinite(logits_soft_cap)
            or logits_soft_cap <= 0
        ):
            raise ValueError(f"logits_soft_cap must be None or a finite Python float > 0, got {logits_soft_cap!r}")
        logits_soft_cap = float(logits_soft_cap)
    if not isinstance(dropout_rate, (int, float)) or isinstance(dropout_rate, bool) or not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be a Python float in [0, 1), got {dropout_rate!r}")
    seed = None
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} needs dropout_rng (a JAX PRNG key)")
        is_key = hasattr(dropout_rng, "dtype") and jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
        is_raw = hasattr(dropout_rng, "dtype") and dropout_rng.dtype == jnp.uint32 and dropout_rng.shape == (2,)
        if not (is_key and dropout_rng.shape == ()) and not is_raw:
            raise TypeError(
                "dropout_rng must be one JAX PRNG key (jax.random.key) or uint32 [2] key data, got "
                f"{getattr(dropout_rng, 'dtype', type(dropout_rng).__name__)} "
                f"{tuple(getattr(dropout_rng, 'shape', ()))}"
            )
        seed = masks.dropout_seed(dropout_rng)
    mods = masks.ScoreMods(
        bias_dims=bias_dims,
        bias_dtype=None if bias is None else jnp.dtype(bias.dtype).name,
        mask_dims=mask_dims,
        alibi=alibi_slopes is not None,
        soft_cap=logits_soft_cap,
        dropout_rate=float(dropout_rate),
        broadcast_dropout=broadcast_dropout and dropout_rate > 0.0,
    )
    return mods, masks.ModArrays(bias, mask, alibi_slopes, seed)


def _python_scalar(name, x, kind):
    """A NumPy or 0-d array scalar as the Python number it holds (options must be static); a traced value
    gets a TypeError saying how to keep it static."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{name} is a traced value, but it selects the computation and must be static. Under jax.jit pass "
            f"flash_attention's options as static arguments: jax.jit(flash_attention, "
            f"static_argnames=pallas_flash.STATIC_ARGNAMES), or close over them with functools.partial"
        )
    if kind is bool and isinstance(x, np.bool_):
        return bool(x)
    if kind is float and isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)):
        return float(x)
    if (
        kind is float
        and isinstance(x, (np.ndarray, jax.Array))
        and x.shape == ()
        and jnp.issubdtype(x.dtype, jnp.floating)
    ):
        return float(x)
    return x


def flash_attention(
    query,
    key,
    value,
    *,
    scale=None,
    is_causal=False,
    segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    block_mask=None,
    bias=None,
    mask=None,
    alibi_slopes=None,
    logits_soft_cap=None,
    dropout_rate=0.0,
    dropout_rng=None,
    broadcast_dropout=False,
    score_mod=None,
    mask_mod=None,
    sinks=None,
    return_lse=False,
    implementation=None,
    config=None,
    deterministic=True,
):
    """Exact scaled dot-product attention in O(seq) memory.

    Args:
      query: [batch, q_len, heads, head_dim].
      key: [batch, kv_len, kv_heads, head_dim], heads % kv_heads == 0 (MHA, GQA, MQA): query head h
        reads kv head h // (heads // kv_heads). q_len and kv_len may differ.
      value: [batch, kv_len, kv_heads, head_dim_v]; head_dim_v may differ from head_dim (DeepSeek's MLA:
        192 and 128), in every implementation.
      scale: softmax scale; default 1 / sqrt(head_dim). A Python float is compiled in; a JAX array (traced
        or learned) is folded into the query before the kernels (one extra rounding of the query to its
        dtype) and gets its gradient.
      is_causal: query i sees key j iff j <= i, as in `jax.nn.dot_product_attention`.
      segment_ids: int [batch, q_len]: packed sequences; a query sees only keys with its segment id.
        kv_segment_ids: int [batch, kv_len], the keys' ids (default: segment_ids, when q_len == kv_len).
        The two most negative int32 values are reserved for padding.
      query_seq_lengths, key_value_seq_lengths: int [batch]: per-example lengths; positions at or past
        them are padding (padded queries get zeros, padded keys are never seen).
      local_window_size: int w or (left, right): query i sees keys i - left .. i + right (None for an
        unbounded side); combined with is_causal, right is 0.
      block_mask: a `BlockMask` (block-sparse attention): query i sees key j only if the mask's block
        (i // block_q, j // block_kv) is True, ANDed with the above. The portable kernels never load False
        blocks (forward and backward), their tiles shrinking to divide the mask's blocks; the Hopper kernels
        skip them where each kernel tile's kept blocks form one run, and otherwise read the mask as a dense
        mask (blocks between kept runs are loaded and hidden).
      bias: float array broadcastable to [batch, heads, q_len, kv_len] (rank <= 4, each dim 1 or full, e.g.
        Flax's [batch, heads, q_len, kv_len] or [1, heads, 1, kv_len]), added to the logits. It is read
        tile by tile, never broadcast in memory; differentiable (its gradient has the bias's own shape, and is
        computed only where the bias is differentiated).
      mask: bool array broadcastable the same way; False hides the key (True = attend).
      alibi_slopes: float [heads] or [batch, heads]: adds -slope * |key_pos - query_pos| to the logits
        (FlashAttention-2's convention; with is_causal that is slope * (key_pos - query_pos)). Treated as
        constants (no gradient).
      logits_soft_cap: float c > 0 or None: logits = c * tanh(logits / c), applied to the scaled logits
        before bias and ALiBi.
      dropout_rate, dropout_rng, broadcast_dropout: dropout on the attention probabilities, kept ones scaled
        by 1 / (1 - rate). dropout_rng is a JAX PRNG key (or uint32 [2] key data), needed when rate > 0.
        The keep mask is `masks.dropout_keep_mask` of (seed, batch, head, query pos, key pos): the same in
        every implementation and for every block size (it is not `jax.random.bernoulli`'s draw). With
        broadcast_dropout one mask is shared by every batch element and head (as Flax's
        broadcast_dropout); otherwise each (batch, head) draws its own.
      score_mod: a function (score, batch, head, q_idx, kv_idx) -> score of scalars (PyTorch flex attention's
        convention), applied to the float32 logit after scale, soft cap, bias and ALiBi; `pallas_flash.mods`
        has the common ones. It may close over arrays (a bias table, slopes): they are arguments of the
        compiled call (new values, no recompile) and get gradients.
      mask_mod: a function (batch, head, q_idx, kv_idx) -> bool (True = attend), ANDed with the masks above;
        may close over arrays (document ids) likewise.
      sinks: float [heads]: attention sinks, a learned logit per head that joins every row's softmax
        denominator (exp(sink)) and attends to nothing; differentiable. A row that sees no key gets zeros.
      return_lse: also return the log-sum-exp of the logits, [batch, heads, q_len] float32 (after soft cap,
        bias, ALiBi, score_mod and masks, with the sink's term; of the softmax before dropout).
      implementation: None (best available: on a Hopper GPU "mosaic" where it serves the call, else
        "pallas" on an NVIDIA GPU, else "xla_chunked"), or force "mosaic" (Hopper only: bf16/fp16, causal,
        window, segment ids and lengths, score modifiers (a bias or mask over both queries and keys read tile
        by tile, where its tiles fit shared memory; blocks a mask hides wholly are skipped) and stageable
        score_mod/mask_mod, a block mask (by its block ranges where its kept blocks form one run per kernel
        tile, else as a dense mask); raises where it cannot serve the call), "pallas" (interpret mode without
        a GPU), "xla_chunked" or "xla" (dense reference).
      config: a `KernelConfig`; default `KernelConfig.default` at the wider of the two head dims, fitted to
        the dtype, the device's shared memory and any dense bias/mask tiles.
      deterministic: True (default): gradients are bitwise the same from run to run. False lets the Hopper
        backward add dQ's float32 partial sums in whatever order they arrive where that is faster (head_dim
        <= 64 on the H100), so dQ varies in its last bits between runs. The other implementations are
        deterministic either way.
    Returns:
      out [batch, q_len, heads, head_dim_v] in query's dtype, and lse if `return_lse`. A query that sees no
      key gets zeros and lse = -inf.

    Each call runs one compiled function per shape, dtype and set of options (`STATIC_ARGNAMES`), so eager
    calls are cached as under `jit`; under `jax.jit` those options must be static.
    """
    options = dict(
        is_causal=is_causal,
        local_window_size=local_window_size,
        block_mask=block_mask,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        return_lse=return_lse,
        implementation=implementation,
        config=config,
        deterministic=deterministic,
    )
    for name, option in options.items():
        _python_scalar(name, option, None)  # a traced option: a TypeError that says how to make it static
    is_causal = _python_scalar("is_causal", is_causal, bool)
    broadcast_dropout = _python_scalar("broadcast_dropout", broadcast_dropout, bool)
    deterministic = _python_scalar("deterministic", deterministic, bool)
    return_lse = _python_scalar("return_lse", return_lse, bool)
    dropout_rate = _python_scalar("dropout_rate", dropout_rate, float)
    if logits_soft_cap is not None:
        logits_soft_cap = _python_scalar("logits_soft_cap", logits_soft_cap, float)
    if isinstance(local_window_size, list):
        local_window_size = tuple(local_window_size)
    scale_value = None
    if scale is not None and not isinstance(scale, (int, float)):
        if isinstance(scale, (np.generic, np.ndarray)) and np.ndim(scale) == 0:
            scale = float(scale)
        elif isinstance(scale, jax.Array) and scale.ndim == 0 and jnp.issubdtype(scale.dtype, jnp.floating):
            scale, scale_value = None, scale
        else:
            raise TypeError(f"scale must be a float or a float scalar array, got {scale!r}")
    if scale is not None and (isinstance(scale, bool) or not math.isfinite(scale)):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    for name, flag in (
        ("is_causal", is_causal),
        ("broadcast_dropout", broadcast_dropout),
        ("deterministic", deterministic),
        ("return_lse", return_lse),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a pallas_flash.KernelConfig, got {type(config).__name__}")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a pallas_flash.BlockMask, got {type(block_mask).__name__}")
    try:
        hash((local_window_size, block_mask, logits_soft_cap, dropout_rate, implementation, config))
    except TypeError as e:
        raise TypeError(f"flash_attention's options must be hashable (they are static): {e}") from None
    mask_mod, is_causal, local_window_size = _fold_band_mod(mask_mod, is_causal, local_window_size)
    score_program, score_consts = (None, ()) if score_mod is None else mods_lib.trace(score_mod, "score")
    mask_program, mask_consts = (None, ()) if mask_mod is None else mods_lib.trace(mask_mod, "mask")
    out, lse = _attention(
        query,
        key,
        value,
        scale_value,
        segment_ids,
        kv_segment_ids,
        query_seq_lengths,
        key_value_seq_lengths,
        bias,
        mask,
        alibi_slopes,
        dropout_rng,
        score_consts,
        mask_consts,
        sinks,
        scale=None if scale is None else float(scale),
        score_mod=score_program,
        mask_mod=mask_program,
        is_causal=is_causal,
        local_window_size=local_window_size,
        block_mask=block_mask,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        implementation=implementation,
        config=config,
        deterministic=deterministic,
    )
    return (out, lse) if return_lse else out


# Every option but return_lse (applied outside) is static, and so is a Python-float scale.
@functools.partial(
    jax.jit, static_argnames=("scale", "score_mod", "mask_mod", *(n for n in STATIC_ARGNAMES if n != "return_lse"))
)
def _attention(
    query,
    key,
    value,
    scale_value,
    segment_ids,
    kv_segment_ids,
    query_seq_lengths,
    key_value_seq_lengths,
    bias,
    mask,
    alibi_slopes,
    dropout_rng,
    score_consts,
    mask_consts,
    sinks,
    *,
    scale,
    score_mod,
    mask_mod,
    is_causal,
    local_window_size,
    block_mask,
    logits_soft_cap,
    dropout_rate,
    broadcast_dropout,
    implementation,
    config,
    deterministic,
):
    """`flash_attention` once its options are static Python values: checks, dispatch and the kernels, traced
    once per shape and option set. Returns (out, lse)."""
    call = _prepare(
        query,
        key,
        value,
        scale_value,
        segment_ids,
        kv_segment_ids,
        query_seq_lengths,
        key_value_seq_lengths,
        bias,
        mask,
        alibi_slopes,
        dropout_rng,
        score_consts,
        mask_consts,
        scale=scale,
        score_mod=score_mod,
        mask_mod=mask_mod,
        is_causal=is_causal,
        local_window_size=local_window_size,
        block_mask=block_mask,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        implementation=implementation,
        config=config,
    )
    sinks = _check_sinks(sinks, query.shape[2])
    if call.impl == "xla":
        return _reference(call, key, value, sinks)
    out, lse = _kernels(call, key, value, deterministic)
    return (out, lse) if sinks is None else _add_sinks(out, lse, sinks)


class _Prepared(typing.NamedTuple):
    """A call past the boundary's checks: the implementation that dispatch chose, and what every implementation
    takes (`query` with a traced scale folded in, `scale` then 1)."""

    impl: str
    query: typing.Any
    scale: float
    band: masks.Band
    config: KernelConfig
    q_ids: typing.Any
    kv_ids: typing.Any
    block_mask: typing.Any
    mods: masks.ScoreMods
    mod_arrays: masks.ModArrays


def _prepare(
    query,
    key,
    value,
    scale_value,
    segment_ids,
    kv_segment_ids,
    query_seq_lengths,
    key_value_seq_lengths,
    bias,
    mask,
    alibi_slopes,
    dropout_rng,
    score_consts,
    mask_consts,
    *,
    scale,
    score_mod,
    mask_mod,
    is_causal,
    local_window_size,
    block_mask,
    logits_soft_cap,
    dropout_rate,
    broadcast_dropout,
    implementation,
    config,
) -> _Prepared:
    """The checks and the dispatch that `flash_attention` and `attention_backward` share (so both run the same
    implementation on the same masks and modifiers for the same options)."""
    _check_inputs(query, key, value)
    band = masks.Band.of(is_causal, _check_window(local_window_size))
    q_ids, kv_ids = _segments(query, key, segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths)
    block_mask = _check_block_mask(block_mask, query, key)
    mods, mod_arrays = _score_mods(
        query, key, bias, mask, alibi_slopes, logits_soft_cap, dropout_rate, dropout_rng, broadcast_dropout
    )
    mods = dataclasses.replace(mods, score_mod=score_mod, mask_mod=mask_mod)
    mod_arrays = mod_arrays._replace(score_consts=tuple(score_consts), mask_consts=tuple(mask_consts))
    head_dim = query.shape[-1]
    if scale_value is not None:  # a traced scale: fold it into the query, the kernels scale by 1
        query = (query.astype(jnp.float32) * scale_value.astype(jnp.float32)).astype(query.dtype)
        scale = 1.0
    elif scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if config is None:  # the portable kernels' tiles fitted at the wider of the two head dims (an upper bound)
        config = KernelConfig.default(
            max(head_dim, value.shape[-1]),
            jnp.dtype(query.dtype).itemsize,
            device.shared_memory_bytes(),
            _score_tile_bytes(mods, mod_arrays),
        )

    # The score modifiers and the block mask a call uses (each implementation says which ones it serves).
    features = (
        ("block_mask", block_mask is not None),
        ("bias", mods.bias_dims is not None),
        ("mask", mods.mask_dims is not None),
        ("alibi_slopes", mods.alibi),
        ("logits_soft_cap", mods.soft_cap is not None),
        ("dropout", mods.dropout_rate > 0.0),
        ("score_mod", score_mod is not None),
        ("mask_mod", mask_mod is not None),
    )
    call = Call(
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        jax.ShapeDtypeStruct(key.shape, key.dtype),
        band,
        config,
        tuple(name for name, used in features if used),
        mods,
        jax.ShapeDtypeStruct(value.shape, value.dtype),
        block_mask,
    )
    impl = dispatch(implementation, call)
    return _Prepared(impl, query, scale, band, config, q_ids, kv_ids, block_mask, mods, mod_arrays)


def _check_sinks(sinks, heads):
    if sinks is None:
        return None
    if not hasattr(sinks, "dtype") or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a float array [heads], got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},) (one logit per query head), got {tuple(sinks.shape)}")
    return sinks


def _add_sinks(out, lse, sinks):
    """Attention sinks on a finished softmax: each row's denominator gains exp(sink), so its weights (and out)
    shrink by exp(lse - lse') with lse' = logaddexp(lse, sink). Exact, differentiable, O(q_len) work."""
    sink = sinks.astype(jnp.float32)[None, :, None]
    new_lse = jnp.logaddexp(lse, sink)
    keep = jnp.exp(lse - new_lse)  # 0 where the row saw no key (lse = -inf)
    out = (out.astype(jnp.float32) * jnp.swapaxes(keep, 1, 2)[..., None]).astype(out.dtype)
    return out, new_lse


def _kernels(call: _Prepared, key, value, deterministic):
    masking = dict(
        q_segment_ids=call.q_ids,
        kv_segment_ids=call.kv_ids,
        block_mask=call.block_mask,
        mods=call.mods,
        mod_arrays=call.mod_arrays,
    )
    if call.impl == "mosaic":
        hopper_mods, hopper_arrays = _hopper_programs(call.mods, call.mod_arrays)
        return hopper.flash_attention_hopper(
            call.query,
            key,
            value,
            scale=call.scale,
            band=call.band,
            config=call.config,
            q_segment_ids=call.q_ids,
            kv_segment_ids=call.kv_ids,
            deterministic=deterministic,
            mods=hopper_mods,
            mod_arrays=hopper_arrays,
            block_mask=call.block_mask,
        )
    if call.impl == "pallas":
        return portable.flash_attention_portable(
            call.query,
            key,
            value,
            scale=call.scale,
            band=call.band,
            config=call.config,
            interpret=not device.on_nvidia_gpu(),
            **masking,
        )
    if call.impl == "xla_chunked":
        return xla_chunked.attention_chunked(
            call.query, key, value, scale=call.scale, band=call.band, block_kv=call.config.xla_block_kv, **masking
        )
    raise AssertionError(call.impl)


def _reference(call: _Prepared, key, value, sinks):
    mods, mod_arrays = call.mods, call.mod_arrays
    return reference.attention_reference(
        call.query,
        key,
        value,
        scale=call.scale,
        band=call.band,
        q_segment_ids=call.q_ids,
        kv_segment_ids=call.kv_ids,
        block_mask=call.block_mask,
        bias=mod_arrays.bias,
        mask=mod_arrays.mask,
        alibi_slopes=mod_arrays.alibi_slopes,
        logits_soft_cap=mods.soft_cap,
        dropout_rate=mods.dropout_rate,
        dropout_seed=mod_arrays.dropout_seed,
        broadcast_dropout=mods.broadcast_dropout,
        score_mod=mods.score_mod,
        score_consts=mod_arrays.score_consts,
        mask_mod=mods.mask_mod,
        mask_consts=mod_arrays.mask_consts,
        sinks=sinks,
    )


# ---- the backward on given residuals ------------------------------------------------------------------------------


def attention_backward(
    query,
    key,
    value,
    out,
    lse,
    d_out,
    d_lse=None,
    *,
    delta=None,
    scale=None,
    is_causal=False,
    segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    block_mask=None,
    mask=None,
    alibi_slopes=None,
    logits_soft_cap=None,
    mask_mod=None,
    implementation=None,
    config=None,
    deterministic=True,
):
    """(dq, dk, dv): the gradient of `flash_attention(query, key, value, return_lse=True, **options)` for the
    cotangents (d_out, d_lse) of its (out, lse), from the residuals `out` and `lse` instead of a forward: the
    backward of the implementation that flash_attention dispatches these options to ("xla", the dense reference,
    recomputes its forward instead).

    The residuals may be those of attention over a larger set of keys that these keys belong to: the backward's
    probabilities exp(S - lse) and its delta = rowsum(d_out * out) - d_lse are then the larger call's, and the
    result is the part of its gradient that flows through these keys (dq's terms of these keys, and their dk and
    dv). Ring attention's backward adds these parts up step by step without recomputing any step's forward.

    Args:
      query, key, value: as `flash_attention`.
      out: [batch, q_len, heads, head_dim_v] in query's dtype; lse: float32 [batch, heads, q_len], natural log,
        -inf for a query that sees no key.
      d_out: like out; d_lse: like lse, or None (zeros).
      delta: None, or float32 [batch, heads, q_len]: rowsum(d_out * out) - d_lse, all the backward reads of out
        and d_lse, for a caller that runs several backwards on the same rows (ring attention's steps form it
        once); given, out and d_lse must be None. Not served by the "xla" implementation, which recomputes its
        forward.
      scale: a Python float, or None for 1 / sqrt(head_dim).
      The other options as `flash_attention`'s: those without a gradient of their own (no bias, score_mod,
      dropout or sinks).
    Returns:
      dq, dk, dv shaped and typed like query, key and value.
    """
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"attention_backward's scale must be a Python float or None, got {scale!r}")
    out_shape = (*query.shape[:3], value.shape[3])
    rows = (query.shape[0], query.shape[2], query.shape[1])
    for name, x, shape in (("out", out, out_shape), ("d_out", d_out, out_shape), ("lse", lse, rows),
                           ("d_lse", d_lse, rows), ("delta", delta, rows)):  # fmt: skip
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if delta is None:
        if out is None:
            raise ValueError("attention_backward needs out (or delta)")
        d_lse = jnp.zeros(lse.shape, jnp.float32) if d_lse is None else d_lse
    elif out is not None or d_lse is not None:
        raise ValueError("attention_backward takes delta in place of out and d_lse: pass out=None, d_lse=None")
    else:  # the backwards read out only for delta: out None tells them d_lse holds -delta
        d_lse = -jnp.asarray(delta, jnp.float32)
    if isinstance(local_window_size, list):
        local_window_size = tuple(local_window_size)
    mask_mod, is_causal, local_window_size = _fold_band_mod(mask_mod, is_causal, local_window_size)
    mask_program, mask_consts = (None, ()) if mask_mod is None else mods_lib.trace(mask_mod, "mask")
    return _attention_backward(
        query,
        key,
        value,
        out,
        lse,
        d_out,
        d_lse,
        segment_ids,
        kv_segment_ids,
        query_seq_lengths,
        key_value_seq_lengths,
        mask,
        alibi_slopes,
        mask_consts,
        scale=None if scale is None else float(scale),
        mask_mod=mask_program,
        is_causal=is_causal,
        local_window_size=local_window_size,
        block_mask=block_mask,
        logits_soft_cap=logits_soft_cap,
        implementation=implementation,
        config=config,
        deterministic=deterministic,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "mask_mod",
        "is_causal",
        "local_window_size",
        "block_mask",
        "logits_soft_cap",
        "implementation",
        "config",
        "deterministic",
    ),
)
def _attention_backward(
    query,
    key,
    value,
    out,
    lse,
    d_out,
    d_lse,
    segment_ids,
    kv_segment_ids,
    query_seq_lengths,
    key_value_seq_lengths,
    mask,
    alibi_slopes,
    mask_consts,
    *,
    scale,
    mask_mod,
    is_causal,
    local_window_size,
    block_mask,
    logits_soft_cap,
    implementation,
    config,
    deterministic,
):
    """`attention_backward` once its options are static: the checks and dispatch of `flash_attention`, then the
    chosen implementation's backward."""
    call = _prepare(
        query,
        key,
        value,
        None,
        segment_ids,
        kv_segment_ids,
        query_seq_lengths,
        key_value_seq_lengths,
        None,
        mask,
        alibi_slopes,
        None,
        (),
        mask_consts,
        scale=scale,
        score_mod=None,
        mask_mod=mask_mod,
        is_causal=is_causal,
        local_window_size=local_window_size,
        block_mask=block_mask,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=0.0,
        broadcast_dropout=False,
        implementation=implementation,
        config=config,
    )
    d_lse = d_lse.astype(jnp.float32)
    if call.impl == "mosaic":
        return _hopper_backward(call, key, value, out, lse, d_out, d_lse, deterministic)
    if call.impl == "pallas":
        return _portable_backward(call, key, value, out, lse, d_out, d_lse)
    if call.impl == "xla_chunked":
        return _chunked_backward(call, key, value, out, lse, d_out, d_lse)
    if out is None:
        raise ValueError(
            'attention_backward\'s delta is not served by the "xla" implementation (it recomputes its forward and '
            "needs d_lse): pass out and d_lse, or choose another implementation"
        )
    primal, vjp = jax.vjp(lambda q, k, v: _reference(call._replace(query=q), k, v, None), call.query, key, value)
    return vjp((d_out.astype(primal[0].dtype), d_lse))


def _hopper_backward(call: _Prepared, key, value, out, lse, d_out, d_lse, deterministic):
    hopper_mods, arrays = _hopper_programs(call.mods, call.mod_arrays)
    return hopper.backward(
        call.query,
        key,
        value,
        out,
        lse,
        d_out,
        d_lse,
        scale=call.scale,
        band=call.band,
        config=call.config,
        q_segment_ids=call.q_ids,
        kv_segment_ids=call.kv_ids,
        deterministic=deterministic,
        mods=hopper_mods,
        mod_arrays=arrays,
        block_mask=call.block_mask,
    )


def _portable_backward(call: _Prepared, key, value, out, lse, d_out, d_lse):
    grads = portable.backward(
        call.query,
        key,
        value,
        out,
        lse,
        (d_out, d_lse),
        scale=call.scale,
        band=call.band,
        config=call.config,
        interpret=not device.on_nvidia_gpu(),
        q_segment_ids=call.q_ids,
        kv_segment_ids=call.kv_ids,
        block_mask=call.block_mask,
        mods=call.mods,
        mod_arrays=call.mod_arrays,
    )
    return grads[:3]


def _chunked_backward(call: _Prepared, key, value, out, lse, d_out, d_lse):
    """The XLA chunked custom_vjp's backward, in its layout: queries grouped by K/V head, [batch, q_len,
    kv_heads, group, head_dim], and (out, lse) [batch, kv_heads, group, q_len(, head_dim_v)] float32."""
    batch, q_len, heads, head_dim = call.query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads

    def by_group(x):  # [batch, q_len, heads, head_dim_v] -> [batch, kv_heads, group, q_len, head_dim_v]
        return jnp.moveaxis(x.astype(jnp.float32), 2, 1).reshape(batch, kv_heads, group, q_len, x.shape[-1])

    def rows(x):  # [batch, heads, q_len] -> [batch, kv_heads, group, q_len]
        return x.reshape(batch, kv_heads, group, q_len)

    q = call.query.reshape(batch, q_len, kv_heads, group, head_dim)
    out = None if out is None else by_group(out)
    residuals = (q, key, value, call.q_ids, call.kv_ids, call.mod_arrays, out, rows(lse))
    dq, dk, dv, *_ = xla_chunked._chunked_bwd(
        call.scale,
        call.band,
        call.config.xla_block_kv,
        call.mods,
        call.block_mask,
        residuals,
        (by_group(d_out), rows(d_lse)),
    )
    return dq.reshape(call.query.shape), dk, dv
