"""The flex suite: score_mod, mask_mod and sinks against our plain kernel, cuDNN and PyTorch's flex_attention.

Cases (bf16, B*N = 16k tokens, H=16, D=128, N=8k by default): causal + soft cap 30 (`mods.soft_cap`); ALiBi
(`mods.alibi`), non-causal and causal; sinks (causal); a per-head, per-key bias table closed over in a score_mod;
`mods.relative_position_bias` (indexed by both positions: not for the Hopper kernels); a dense bias `bias=` [1, 1, N,
N] bf16 (with its gradient); a document mask of 8 equal documents (`mods.document`), and the same as a dense `mask=`
[B, 1, N, N]; a causal sliding window of 1k keys (`mods.sliding_window`) at N = 2 x 8k, batch 1, and the same
window with 64 global keys every query also sees (attention-sink tokens; `mods.or_masks`); Longformer's pattern, 64
global tokens that see and are seen by every token beside a non-causal window of 512 keys each side, at 2 x 8k;
the same pattern as a `BlockMask` (`BlockMask.global_local`: 128-blocks, the first global both ways, a window of 4
blocks each side), at 2 x 8k.
Each case and pass has one row per variant, every one timed in interleaved pairs with `mod` (`benchmarks.timing`):
  mod         flash_attention with the modifier, by the first of mosaic, pallas, xla_chunked that takes it (the
              refusals before it in the note): `impl` is what ran;
  plain       the same call without the modifier (causal where the modifier keeps causal keys only);
  band        the sliding window as `local_window_size=(1024, 0)`, the built-in band (for the global cases their
              window alone: not the modifier's function, the work it keeps but for the global keys and queries);
  as_mask     a block mask case's mask expanded into a dense `mask=` [1, 1, N, N] (the block mask's function);
  cudnn       jax.nn.dot_product_attention(implementation="cudnn") with the modifier as an explicit bias ([1, H, N,
              N] bf16 for ALiBi, [1, H, 1, N] for the bias table), mask ([B, 1, N, N] bool for documents) or
              local_window_size; no row where jax.nn cannot say it (soft cap, sinks, relative positions);
  torch_flex  torch.compile(flex_attention) on [B, H, N, D] with its own create_block_mask, on causal + soft cap,
              ALiBi, documents, the windows and the block mask (a mask_mod reading it per token); compile time
              excluded (the warm-up calls compile), each sample ended by torch.cuda.synchronize; skipped without
              torch or CUDA.
  mod@TILES   with `--hopper`: mod on the given Hopper forward tiles (the bar's syntax, e.g. "64,128,2,persistent"),
              one row per tile set, to try a default against the case (< 1: those tiles are faster).
  mod@bwd:..  with `--bwd`: mod on the plain call's default Hopper backward with the given field overrides (the
              bar's syntax, e.g. "dq_overlap=0,num_stages_dq=2"), one row per item, likewise.
`ratio_to_mod` = this row's ms / mod's ms (> 1: the modifier in our kernel is faster), with its ~95% interval;
mod's own ms is from its pairing with plain. On plain and band rows, `kept_work_ratio` = mod's ms / (this row's ms
scaled to the logits mod keeps): a mask should cost about the dense work it keeps (target <= 1.15 for documents).
TFLOP/s count the kept logits: 4*B*H*N*N*D times the kept fraction per forward, 3.5x that for fwd+bwd. Before it
is timed, every row that computes the modifier's function is checked (forward output, batch 0, the first 256
queries) against the float32 dense reference (`implementation="xla"` on the host); a wrong one gets FAIL.
Last, block-mask construction: the block classes of a document mask (`mods.block_classes` under jit, B=8, N=32k,
128 x 128 blocks; target <= 1 ms) paired with torch's create_block_mask of the same mask.
With `--smoke` (CPU): tiny float32 shapes, the XLA path (xla_chunked), no peers, `SMOKE_CASES` unless --cases
names others, fwd+bwd for the first case only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import report, timing
from benchmarks.bar import describe, describe_bwd, kernel_config, parse_bwd_overrides, parse_hopper_configs
from benchmarks.impls import Unsupported
from benchmarks.inputs import DTYPES, FLOP_FACTOR, Point, compile_pass, random_inputs
from benchmarks.timing import TorchSynced
from pallas_flash import mods
from pallas_flash.block_sparse import MASK_BLOCK_MULTIPLE
from pallas_flash.device import on_nvidia_gpu
from tests import tolerances

CAP = 30.0  # Gemma 2's attention soft cap
DOCUMENTS = 8
GLOBAL_KEYS = 64  # the global cases' keys every query sees (and, for global_tokens, queries that see every key)
# block_global_local's BlockMask: blocks of an eighth of the window (128 x 128), the first block global both ways,
# a window of 4 blocks each side
GLOBAL_BLOCKS, WINDOW_BLOCKS = 1, 4
RELATIVE_REACH = 128  # relative_position_bias's table covers kv_idx - q_idx in [-128, 128]
CHECK_ROWS = 256  # queries of batch 0 checked against the dense reference (it holds rows x N logits per head)
ROTATE = 3  # input sets each function rotates over while timed (so none stays in L2)
OURS = ("mosaic", "pallas", "xla_chunked")  # flash_attention's implementations in the dispatcher's order
FULL, CAUSAL = (None, None), (None, 0)  # (left, right) reach of a band; None is unbounded
DOCUMENT_TARGET = 1.15  # the document mask's kept_work_ratio
BLOCK_CLASSES_TARGET_MS = 1.0
BLOCK_CLASSES = "block_classes"  # the block-mask construction's rows
# The cases each peer can say (jax.nn has no soft cap or sinks, and a relative-position bias would be N x N).
PEER_CASES = {
    "cudnn": (
        "alibi",
        "alibi_causal",
        "bias_table",
        "dense_bias",
        "document",
        "dense_mask",
        "sliding_window",
        "global_window",
        "global_tokens",
        "block_global_local",
    ),
    "torch_flex": (
        "soft_cap_causal",
        "alibi",
        "alibi_causal",
        "document",
        "sliding_window",
        "global_window",
        "global_tokens",
        "block_global_local",
    ),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A run's shapes: B*N = `tokens`, `heads`, the sliding window's reach, and the block-mask build's shape."""

    tokens: int = 16384
    heads: int = 16
    dtype: str = "bfloat16"
    window: int = 1024
    block_classes: tuple = (8, 32768, 128)  # batch, q_len = kv_len, block_q = block_kv


SMOKE = Sizes(tokens=256, heads=2, dtype="float32", window=16, block_classes=(2, 256, 32))
SMOKE_SEQ = 128


@dataclasses.dataclass(frozen=True)
class Case:
    """One modifier. `mod(arrays)`: flash_attention's keyword arguments with it, from the arrays it closes over
    (`arrays(point)` makes them, numpy; `mod` sees them on the device, or traced). `band` and `documents`: the
    logits it keeps (with `global_keys`: the first keys, which every query sees too, and with `global_queries` the
    same first queries see every key); `block_mask`: None, or the `BlockMask` the case passes at N (its kept blocks
    are the logits kept); `partners`: ours without it ("plain", "band") or with the block mask expanded into a
    dense `mask=` ("as_mask"); `seq_factor`: N is this times the suite's; `query_rows`: the [batch, heads, q_len,
    kv_len] arrays (cut to the reference's batch and rows)."""

    name: str
    mod: Callable[[dict], dict]
    arrays: Callable[[Point], dict] = lambda point: {}
    band: tuple = FULL
    documents: int = 1
    global_keys: int = 0
    global_queries: bool = False
    block_mask: Callable[[int], pf.BlockMask] | None = None
    partners: tuple = ("plain",)
    seq_factor: int = 1
    query_rows: tuple = ()

    @property
    def causal(self) -> bool:
        return self.band[1] == 0

    def at(self, seq: int) -> Case:
        """This case at N = seq: its block mask (if any) passed by `mod`."""
        if self.block_mask is None:
            return self
        block_mask = self.block_mask(seq)
        return dataclasses.replace(self, mod=lambda a, mod=self.mod: dict(mod(a), block_mask=block_mask))

    def kept(self, seq: int) -> float:
        if self.block_mask is not None:
            return block_kept_fraction(self.block_mask(seq), seq)
        return kept_fraction(
            seq, *self.band, documents=self.documents, global_keys=self.global_keys, global_queries=self.global_queries
        )


def kept_fraction(
    seq: int, left=None, right=None, *, documents: int = 1, global_keys: int = 0, global_queries: bool = False
) -> float:
    """The fraction of the seq x seq logits that a band (query i sees keys i - left .. i + right) within
    `documents` equal documents keeps, with (one document) the first `global_keys` keys seen by every query as
    well, and with `global_queries` every key seen by those first queries; exact, counted row by row."""
    i = np.arange(seq)
    size = seq // documents
    start = i // size * size
    low = start if left is None else np.maximum(start, i - left)
    high = start + size - 1 if right is None else np.minimum(start + size - 1, i + right)
    global_before = np.clip(np.minimum(global_keys, low) - start, 0, None)  # global keys left of the band
    seen = np.maximum(high - low + 1, 0) + global_before
    if global_queries:
        seen = np.where(i < global_keys, seq, seen)
    return float(seen.sum()) / seq**2


def block_kept_fraction(block_mask, seq: int) -> float:
    """The fraction of the seq x seq logits a [1, 1, ...] block mask keeps (its ragged last blocks counted short)."""
    rows = np.diff(np.minimum(np.arange(block_mask.shape[2] + 1) * block_mask.block_q, seq))
    cols = np.diff(np.minimum(np.arange(block_mask.shape[3] + 1) * block_mask.block_kv, seq))
    return float(rows @ block_mask.mask[0, 0] @ cols) / seq**2


def global_local_blocks(block: int):
    """block_global_local's block mask at N = seq (`BlockMask.global_local` of block x block blocks), as a function
    of seq."""
    return lambda seq: pf.BlockMask.global_local(seq, seq, GLOBAL_BLOCKS, WINDOW_BLOCKS, block_q=block, block_kv=block)


def key_bias(table):
    """score_mod: score + table[head, kv_idx], a learned bias per head and key position (table: [heads, kv_len])."""
    return lambda s, b, h, q, k: s + table[h, k]


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / heads), float32 [heads]."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def document_ids(batch: int, seq: int) -> np.ndarray:
    """int32 [batch, seq]: DOCUMENTS equal documents in each row."""
    return np.broadcast_to(np.repeat(np.arange(DOCUMENTS, dtype=np.int32), seq // DOCUMENTS), (batch, seq)).copy()


def document_mask(batch: int, seq: int) -> np.ndarray:
    """bool [batch, 1, seq, seq]: the document mask of `document_ids` as an explicit array."""
    ids = document_ids(batch, seq)
    return ids[:, None, :, None] == ids[:, None, None, :]


def _normal(*shape):
    """A fixed float32 standard-normal array (a learned parameter's stand-in: sinks, bias tables)."""
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def cases(window: int) -> list[Case]:
    """The suite's cases; `window`: the sliding window's reach to the left."""

    def alibi(causal):  # fixed slopes, as ALiBi's: no gradient
        return lambda a: dict(is_causal=causal, score_mod=mods.alibi(jax.lax.stop_gradient(a["slopes"])))

    slopes = lambda p: {"slopes": alibi_slopes(p.heads)}
    key_table = lambda p: {"table": _normal(p.heads, p.seq_k)}
    return [
        Case("soft_cap_causal", lambda a: dict(is_causal=True, score_mod=mods.soft_cap(CAP)), band=CAUSAL),
        Case("alibi", alibi(False), slopes),
        Case("alibi_causal", alibi(True), slopes, band=CAUSAL),
        Case(
            "sinks",
            lambda a: dict(is_causal=True, sinks=a["sinks"]),
            lambda p: {"sinks": _normal(p.heads)},
            band=CAUSAL,
        ),
        Case("bias_table", lambda a: dict(score_mod=key_bias(a["table"])), key_table),
        Case(
            "relative_position_bias",
            lambda a: dict(score_mod=mods.relative_position_bias(a["table"])),
            lambda p: {"table": _normal(p.heads, 2 * RELATIVE_REACH + 1)},
        ),
        Case(
            "document",
            lambda a: dict(mask_mod=mods.document(a["ids"])),
            lambda p: {"ids": document_ids(p.batch, p.seq_q)},
            documents=DOCUMENTS,
        ),
        Case(
            "dense_bias",
            lambda a: dict(bias=a["bias"]),
            lambda p: {"bias": _normal(1, 1, p.seq_q, p.seq_k).astype(jnp.bfloat16)},
            query_rows=("bias",),
        ),
        Case(
            "dense_mask",
            lambda a: dict(mask=a["mask"]),
            lambda p: {"mask": document_mask(p.batch, p.seq_q)},
            documents=DOCUMENTS,
            query_rows=("mask",),
        ),
        Case(
            "sliding_window",
            lambda a: dict(mask_mod=mods.sliding_window(window, 0)),
            band=(window, 0),
            partners=("plain", "band"),
            seq_factor=2,
        ),
        Case(
            "global_tokens",
            lambda a: dict(
                mask_mod=mods.or_masks(global_keys, global_queries, mods.sliding_window(window // 2, window // 2))
            ),
            band=(window // 2, window // 2),
            global_keys=GLOBAL_KEYS,
            global_queries=True,
            partners=("plain", "band"),
            seq_factor=2,
        ),
        Case(
            "global_window",
            lambda a: dict(is_causal=True, mask_mod=mods.or_masks(global_keys, mods.sliding_window(window, 0))),
            band=(window, 0),
            global_keys=GLOBAL_KEYS,
            partners=("plain", "band"),
            seq_factor=2,
        ),
        Case(
            "block_global_local",
            lambda a: {},
            block_mask=global_local_blocks(max(MASK_BLOCK_MULTIPLE, window // 8)),
            partners=("plain", "as_mask"),
            seq_factor=2,
        ),
    ]


def global_keys(b, h, q_idx, kv_idx):
    """mask_mod: the first GLOBAL_KEYS keys, seen by every query."""
    return kv_idx < GLOBAL_KEYS


def global_queries(b, h, q_idx, kv_idx):
    """mask_mod: the first GLOBAL_KEYS queries see every key."""
    return q_idx < GLOBAL_KEYS


def cudnn_kwargs(case: Case, a: dict, point: Point) -> dict:
    """jax.nn.dot_product_attention's keyword arguments that say what `case`'s modifier does (one of
    PEER_CASES["cudnn"]), from its arrays (on the device)."""
    dtype = DTYPES[point.dtype]
    if case.block_mask is not None:
        return dict(mask=jnp.asarray(case.block_mask(point.seq_q).expand(point.seq_q, point.seq_k)))
    if case.name in ("alibi", "alibi_causal"):
        pos = jnp.arange(point.seq_q)
        bias = -a["slopes"][:, None, None] * jnp.abs(pos[None, :] - pos[:, None]).astype(jnp.float32)
        return dict(bias=bias[None].astype(dtype), is_causal=case.causal)
    if case.name == "bias_table":
        return dict(bias=a["table"][None, :, None, :].astype(dtype))
    if case.name == "document":
        return dict(mask=a["ids"][:, None, :, None] == a["ids"][:, None, None, :])
    if case.name in ("dense_bias", "dense_mask"):
        return {name: a[name] for name in case.query_rows}
    if case.name == "sliding_window":
        return dict(is_causal=True, local_window_size=case.band)
    if case.name in ("global_window", "global_tokens"):
        q, k = jnp.arange(point.seq_q)[:, None], jnp.arange(point.seq_k)[None, :]
        g = case.global_keys
        if case.name == "global_window":
            return dict(mask=((q >= k) & ((q - k <= case.band[0]) | (k < g)))[None, None])
        return dict(mask=((jnp.abs(q - k) <= case.band[0]) | (k < g) | (q < g))[None, None])
    raise ValueError(f"jax.nn cannot say the {case.name} case")


def torch_mods(case: Case, t: dict):
    """flex_attention's (score_mod, mask_mod) for `case` (one of PEER_CASES["torch_flex"]), over its arrays as
    torch tensors `t`."""
    import torch

    def causal(b, h, q, k):
        return q >= k

    def alibi(s, b, h, q, k):
        return s - t["slopes"][h] * (k - q).abs()

    def block_mask(b, h, q, k):  # the case's BlockMask as a token mask (square blocks)
        return t["blocks"][q // t["block"], k // t["block"]]

    return {
        "soft_cap_causal": (lambda s, b, h, q, k: CAP * torch.tanh(s / CAP), causal),
        "alibi": (alibi, None),
        "alibi_causal": (alibi, causal),
        "document": (None, lambda b, h, q, k: t["ids"][b, q] == t["ids"][b, k]),
        "sliding_window": (None, lambda b, h, q, k: (q >= k) & (q - k <= case.band[0])),
        "global_window": (None, lambda b, h, q, k: (q >= k) & ((q - k <= case.band[0]) | (k < case.global_keys))),
        "global_tokens": (
            None,
            lambda b, h, q, k: ((q - k).abs() <= case.band[0]) | (k < case.global_keys) | (q < case.global_keys),
        ),
        "block_global_local": (None, block_mask),
    }[case.name]


# ---------------------------------------------------------------------------------------------- building


class Timed(NamedTuple):
    """A variant ready to time: what ran, the function and its argument sets, its forward output on the first
    set (numpy [batch, seq, heads, head_dim], the fwd pass only), and the refusals before it."""

    impl: str
    fn: Callable
    args: list
    output: Callable[[], np.ndarray]
    note: str = ""


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def _jax_timed(impl, fn, point, pass_, inputs, extra, note=""):
    compiled, args = compile_pass(fn, pass_, inputs, extra=(extra,))
    return Timed(impl, compiled, args, lambda: np.asarray(compiled(*args[0]), np.float32), note)


def ours(kwargs_of, point, pass_, inputs, arrays, chain) -> Timed:
    """flash_attention(q, k, v, **kwargs_of(arrays)) by the first implementation of `chain` that compiles it."""
    refusals = []
    for name in chain:
        fn = lambda q, k, v, a: pf.flash_attention(q, k, v, scale=point.scale, implementation=name, **kwargs_of(a))
        try:
            return _jax_timed(f"pf:{name}", fn, point, pass_, inputs, arrays, "; ".join(refusals))
        except Exception as e:  # noqa: BLE001 - a refusal (ValueError) or a kernel that does not compile
            refusals.append(f"{name}: {_short(e)}")
    raise Unsupported("; ".join(refusals))


def cudnn(case, point, pass_, inputs, arrays):
    """cuDNN through jax.nn with the modifier as a bias, mask or window."""
    if not on_nvidia_gpu():
        raise Unsupported("cuDNN needs an NVIDIA GPU")
    kwargs = cudnn_kwargs(case, arrays, point)
    dynamic = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}  # made once, passed as arguments
    static = {k: v for k, v in kwargs.items() if k not in dynamic}
    fn = lambda q, k, v, d: jax.nn.dot_product_attention(
        q, k, v, scale=point.scale, implementation="cudnn", **static, **d
    )
    return _jax_timed("cudnn", fn, point, pass_, inputs, dynamic)


def _torch():
    """torch, where flex_attention can run on CUDA (else Unsupported saying why)."""
    try:
        import torch
        from torch.nn.attention import flex_attention  # noqa: F401 - the check that it exists
    except ImportError as e:
        raise Unsupported(f"torch flex_attention is not importable ({e})") from None
    if not torch.cuda.is_available():
        raise Unsupported("torch sees no CUDA device")
    # One compiled flex_attention recompiles per modifier; the default cache limit (8) would fall back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch


def torch_flex(case, point, pass_, inputs, arrays_np):
    """torch.compile(flex_attention) with `case`'s modifier on [B, H, N, D] copies of the inputs."""
    torch = _torch()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t = {name: torch.from_numpy(x).cuda() for name, x in arrays_np.items()}
    if case.block_mask is not None:
        blocks = case.block_mask(point.seq_q)
        t.update(blocks=torch.from_numpy(blocks.mask[0, 0].copy()).cuda(), block=blocks.block_q)
    score_mod, mask_mod = torch_mods(case, t)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, point.batch, None, point.seq_q, point.seq_k, device="cuda")
    flex = torch.compile(flex_attention)

    def attend(q, k, v):
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=point.scale)

    fn, args = timing.torch_pass(attend, pass_, inputs, point.dtype)
    output = lambda: fn(*args[0]).value.transpose(1, 2).float().cpu().numpy()
    return Timed(f"torch {torch.__version__} flex_attention", fn, args, output)


# ---------------------------------------------------------------------------------------------- measuring


def reference(case, point, inputs, arrays_np, rows):
    """The modifier's output for batch 0 and the first `rows` queries: float32, dense, on the host."""
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(np.asarray(x[:1], np.float32), cpu) for x in inputs[:3])
    a = {name: jax.device_put(x[:1, :, :rows] if name in case.query_rows else x, cpu) for name, x in arrays_np.items()}
    kwargs = case.mod(a)
    if "block_mask" in kwargs:  # its first rows of blocks
        blocks = kwargs["block_mask"]
        kwargs["block_mask"] = pf.BlockMask(blocks.mask[:, :, : -(-rows // blocks.block_q)], blocks.block_q,
                                            blocks.block_kv)  # fmt: skip
    with jax.default_device(cpu):  # what flash_attention makes outside its jit stays on the host too
        return np.asarray(pf.flash_attention(q[:, :rows], k, v, scale=point.scale, implementation="xla", **kwargs))


def check(timed, ref, tolerance) -> dict:
    """The forward output's relative error on the reference's rows; status "fail" above the tolerance."""
    out = timed.output()[:1, : ref.shape[1]]
    error = tolerances.relative_error(out, ref) if np.all(np.isfinite(out)) else math.inf
    fields = dict(rel_err=error, tolerance=tolerance)
    if error > tolerance:
        fields.update(status="fail", note=f"relative error {error:.1e} > {tolerance:.0e}")
    return fields


def _row_emitter(emit, case: str, point: Point, pass_: str):
    """row(variant, **fields): emit one row of this case, point and pass."""
    return lambda variant, **fields: emit(dict(case=case, variant=variant, pass_=pass_, point=point, **fields))


def measure_case(case, point, passes, settings, emit) -> None:
    """Every variant of one case at one point, each pass; `emit(fields)` receives each row."""
    case = case.at(point.seq_q)
    arrays_np = case.arrays(point)
    arrays = {name: jnp.asarray(x) for name, x in arrays_np.items()}
    inputs = [random_inputs(point, seed) for seed in range(settings["rotate"])]
    ref = reference(case, point, inputs[0], arrays_np, min(CHECK_ROWS, point.seq_q))
    tolerance = tolerances.OUTPUT[jnp.dtype(DTYPES[point.dtype]).type]
    kept = case.kept(point.seq_q)
    plain_band = CAUSAL if case.causal else FULL
    partners = {  # variant: (kept fraction, computes the modifier's function, build(pass) -> Timed)
        "plain": (
            kept_fraction(point.seq_q, *plain_band),
            False,
            lambda p: ours(lambda a: dict(is_causal=case.causal), point, p, inputs, {}, settings["chain"]),
        ),
        "band": (
            kept_fraction(point.seq_q, *case.band),
            case.global_keys == 0,
            lambda p: ours(lambda a: dict(local_window_size=case.band), point, p, inputs, {}, settings["chain"]),
        ),
        "as_mask": (
            kept,
            True,
            lambda p: ours(
                lambda a: dict(mask=a["mask"]), point, p, inputs, cudnn_kwargs(case, {}, point), settings["chain"]
            ),
        ),
        "cudnn": (kept, True, lambda p: cudnn(case, point, p, inputs, arrays)),
        "torch_flex": (kept, True, lambda p: torch_flex(case, point, p, inputs, arrays_np)),
    }
    variants = [(describe(tiles), dict(hopper=tiles)) for tiles in settings["tiles"]]
    variants += [(describe_bwd(overrides).strip(), dict(bwd=overrides)) for overrides in settings["bwd"]]
    for label, forced in variants:  # mod on other Hopper tiles (--hopper) or backwards (--bwd)
        config = kernel_config(point.head_dim, point.seq_k, case.causal, True, **forced)
        partners[f"mod@{label}"] = (
            kept,
            True,
            lambda p, c=config: ours(lambda a: dict(case.mod(a), config=c), point, p, inputs, arrays, ("mosaic",)),
        )
    peers = () if settings["smoke"] else [p for p in PEER_CASES if case.name in PEER_CASES[p]]
    reps, min_sample_s = settings["reps"], settings["min_sample_ms"] / 1e3
    wrong = set()  # variants whose forward failed the check: their fwd+bwd is not timed either
    for pass_ in passes:
        flops = 4.0 * point.size() * FLOP_FACTOR[pass_]
        row = _row_emitter(emit, case.name, point, pass_)
        if "mod" in wrong:
            row("mod", status="skip", note="its forward failed the check", kept_fraction=kept)
            continue
        try:
            mod = ours(case.mod, point, pass_, inputs, arrays, settings["chain"])
            checked = check(mod, ref, tolerance) if pass_ == "fwd" else {}
        except Exception as e:  # noqa: BLE001 - no implementation takes it: the case has no numbers
            row("mod", status="skip", note=_short(e), kept_fraction=kept)
            continue
        if checked.get("status") == "fail":
            wrong.add("mod")
            row("mod", impl=mod.impl, kept_fraction=kept, **checked)
            continue
        mod_ms = None
        for variant in (*case.partners, *peers, *(name for name in partners if name.startswith("mod@"))):
            variant_kept, same, build = partners[variant]
            if variant in wrong:
                row(variant, status="skip", note="its forward failed the check", kept_fraction=variant_kept)
                continue
            try:
                timed = build(pass_)
                fields = check(timed, ref, tolerance) if same and pass_ == "fwd" else {}
                if fields.get("status") == "fail":
                    wrong.add(variant)
                    row(variant, impl=timed.impl, kept_fraction=variant_kept, **fields)
                    continue
                p = timing.paired_ratio(mod.fn, mod.args, timed.fn, timed.args, reps=reps, min_sample_s=min_sample_s)
            except Exception as e:  # noqa: BLE001 - a peer that refuses (cuDNN, torch) or is missing: a note
                row(variant, status="skip", note=_short(e), kept_fraction=variant_kept)
                continue
            mod_ms = mod_ms or p.ours_ms
            if variant in ("plain", "band") and variant_kept != kept:  # mod's ms / this ms scaled to mod's work
                scale = variant_kept / kept
                fields.update(kept_work_ratio=scale / p.ratio, kept_work_interval=[scale / p.high, scale / p.low])
                if case.name == "document":
                    fields["target"] = DOCUMENT_TARGET
            row(
                variant,
                impl=timed.impl,
                note=timed.note,
                ms=p.theirs_ms,
                tflops=flops * variant_kept / (p.theirs_ms * 1e-3) / 1e12,
                kept_fraction=variant_kept,
                mod_ms=p.ours_ms,
                ratio_to_mod=p.ratio,
                ratio_interval=[p.low, p.high],
                calls_per_sample=p.calls,
                **fields,
            )
        if mod_ms is None:
            mod_ms = timing.median_ms(mod.fn, mod.args, reps=reps, min_sample_s=min_sample_s).ms
        tflops = flops * kept / (mod_ms * 1e-3) / 1e12
        row("mod", impl=mod.impl, note=mod.note, ms=mod_ms, tflops=tflops, kept_fraction=kept, **checked)


def measure_block_classes(sizes, settings, emit) -> None:
    """`mods.block_classes` of a document mask under jit, paired with torch's create_block_mask of it."""
    batch, seq, block = sizes.block_classes
    point = Point("flex", batch, seq, seq, 1, 1, 1, False, "int32")
    ids = document_ids(batch, seq)
    program, consts = mods.trace(mods.document(jnp.asarray(ids)), "mask")
    shape = dict(batch=batch, heads=1, q_len=seq, kv_len=seq, block_q=block, block_kv=block)
    ours_fn = jax.jit(lambda consts: mods.block_classes(program, consts, **shape))
    reps, min_sample_s = settings["reps"], settings["min_sample_ms"] / 1e3
    row = _row_emitter(emit, BLOCK_CLASSES, point, "build")
    try:
        if settings["smoke"]:
            raise Unsupported("smoke run: no peers")
        theirs, impl = torch_block_mask(ids, block)
        jax.block_until_ready(theirs())  # fails here, not inside the timing, where torch cannot build it
    except Exception as e:  # noqa: BLE001 - torch missing or refusing: a note
        row("torch_flex", status="skip", note=_short(e))
        theirs = None
    try:
        if theirs is None:
            ms = timing.median_ms(ours_fn, [(consts,)], reps=reps, min_sample_s=min_sample_s).ms
        else:
            p = timing.paired_ratio(ours_fn, [(consts,)], theirs, [()], reps=reps, min_sample_s=min_sample_s)
            ms = p.ours_ms
    except Exception as e:  # noqa: BLE001 - e.g. out of memory at this size
        row("mod", status="skip", note=_short(e), impl="mods.block_classes")
        return
    row("mod", impl="mods.block_classes", ms=ms, target=BLOCK_CLASSES_TARGET_MS)
    if theirs is not None:
        row(
            "torch_flex",
            impl=impl,
            ms=p.theirs_ms,
            mod_ms=p.ours_ms,
            ratio_to_mod=p.ratio,
            ratio_interval=[p.low, p.high],
        )


def torch_block_mask(ids: np.ndarray, block: int):
    """(a function () -> torch's create_block_mask of the document mask of `ids` [batch, seq], awaitable by
    `jax.block_until_ready`; its name and version)."""
    torch = _torch()
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = ids.shape
    t_ids = torch.from_numpy(ids).cuda()
    mask_mod = lambda b, h, q, k: t_ids[b, q] == t_ids[b, k]
    build = lambda: TorchSynced(create_block_mask(mask_mod, batch, None, seq, seq, device="cuda", BLOCK_SIZE=block))
    return build, f"torch {torch.__version__} create_block_mask"


def record(stamp, *, case, variant, pass_, point, status="ok", note="", **fields) -> dict:
    """One row of results.json: the point, the variant and what was measured, with the run's `stamp`."""
    rec = dict(
        suite="flex",
        case=case,
        variant=variant,
        impl=None,
        point=point.key(),
        batch=point.batch,
        seq_q=point.seq_q,
        seq_k=point.seq_k,
        heads=point.heads,
        kv_heads=point.kv_heads,
        head_dim=point.head_dim,
        causal=point.causal,
        dtype=point.dtype,
        ms=None,
        tflops=None,
        kept_fraction=None,
        mod_ms=None,
        ratio_to_mod=None,
        ratio_interval=None,
        kept_work_ratio=None,
        kept_work_interval=None,
        target=None,
        rel_err=None,
        tolerance=None,
        status=status,
        note=note,
        **stamp,
    )
    rec["pass"] = pass_
    rec.update(fields)
    return rec


def case_names() -> list[str]:
    """What `--cases` may name: every case, then the block-mask build."""
    return [case.name for case in cases(SMOKE.window)] + [BLOCK_CLASSES]


# A smoke run's cases: one of each kind of row the suite writes (a score program, with forward+backward; sinks; a
# dense operand; a sparse mask with its kept work; a band with its built-in partner), then the block-mask build.
# Every mod's numbers are tests/test_mods.py's.
SMOKE_CASES = ("soft_cap_causal", "sinks", "dense_bias", "document", "sliding_window", BLOCK_CLASSES)


def run(
    *,
    seqs,
    head_dims,
    passes,
    names=None,
    reps=None,
    min_sample_ms=None,
    time_budget=None,
    smoke=False,
    stamp=None,
    on_record=None,
    hopper=None,
    bwd=None,
) -> list[dict]:
    """Measure the suite (the cases in `names`, default all of `case_names()`); returns its records (each with the
    fields of `stamp`). `on_record(records)` is called after each (the caller writes them, so a cut-off run keeps
    what it measured). `hopper`: the `--hopper` text (`bar.parse_hopper_configs`), mod's extra tile sets; `bwd`: the
    `--bwd` text (`bar.parse_bwd_overrides`), mod's extra backwards."""
    names = names or (SMOKE_CASES if smoke else case_names())
    sizes = SMOKE if smoke else Sizes()
    settings = dict(
        smoke=smoke,
        reps=reps or (3 if smoke else 15),
        min_sample_ms=0.0 if smoke else 10.0 if min_sample_ms is None else min_sample_ms,
        rotate=1 if smoke else ROTATE,
        chain=OURS if on_nvidia_gpu() else ("xla_chunked",),  # off the GPU the kernels would run interpreted
        tiles=[c for c in parse_hopper_configs(hopper) if c is not None],
        bwd=[o for o in parse_bwd_overrides(bwd) if o],
    )
    passes = sorted(passes, key=("fwd", "fwdbwd").index)  # fwd first: its check decides whether fwd+bwd is timed
    records, start = [], time.perf_counter()

    def emit(fields):
        records.append(record(dict(stamp or {}, smoke=smoke), **fields))
        print(report.flex_row(records[-1]), flush=True)
        if on_record:
            on_record(records)

    print("\n".join(report.flex_header()), flush=True)
    for head_dim in head_dims:
        for seq in seqs:
            for i, case in enumerate(c for c in cases(sizes.window) if c.name in names):
                if time_budget and time.perf_counter() - start > time_budget:
                    print(f"time budget of {time_budget:.0f} s spent: stopped before {case.name} N={seq} D={head_dim}")
                    return records
                n = seq * case.seq_factor
                batch = max(1, sizes.tokens // n)
                point = Point("flex", batch, n, n, sizes.heads, sizes.heads, head_dim, case.causal, sizes.dtype)
                # A smoke run takes fwd+bwd through the harness once (the first case): its path is every case's.
                case_passes = [p for p in passes if p == "fwd" or i == 0] if smoke and "fwd" in passes else passes
                measure_case(case, point, case_passes, settings, emit)
    if BLOCK_CLASSES in names:
        measure_block_classes(sizes, settings, emit)
    return records


def share_the_gpu_with_torch() -> None:
    """Where torch can be imported, leave it half the GPU: JAX otherwise preallocates 75% of it. Call before JAX
    starts its GPU client; a value the caller set wins."""
    if importlib.util.find_spec("torch") is not None:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
