"""Head dims past 128 and a value head_dim of its own in the Hopper kernels: DeepSeek MLA's (query/key, value) head
dims (192, 128) and (128, 64) forward and backward (V, dO, dV and the output at value's head_dim), and the backward
at head_dim 256 (`HopperBwdConfig.split_columns`: each pass's two consumers share one block of rows and each
accumulates half of the head_dim columns). The kernels in JAX's Mosaic GPU interpreter (race detection on) against
the float32 reference, their lowering for CUDA, the defaults' shared-memory fit and dispatch, and on an H100 the
public API and its gradients against the reference.

Interpreter tiles are the smallest the kernels take (64-row blocks); every case has ragged lengths and GQA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, device, masks, mods, reference
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.config import H100_SHARED_MEMORY, HopperBwdConfig, HopperConfig
from tests.helpers import MOSAIC_CALL, assert_gradients_close, interpreted_hopper_backward, lower_for_cuda, packed_ids
from tests.tolerances import GRADIENT, assert_close

SCALE = 0.1


def _inputs(shape, seed, dtype=jnp.bfloat16):
    """(q, k, v, d_out, d_lse) for a (batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v) shape: unit
    normals drawn by NumPy, a small float32 lse cotangent."""
    batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v = shape
    rng = np.random.default_rng(seed)

    def draw(*dims):
        return jnp.asarray(rng.standard_normal(dims, np.float32)).astype(dtype)

    q, k = draw(batch, q_len, heads, head_dim), draw(batch, kv_len, kv_heads, head_dim)
    v, d_out = draw(batch, kv_len, kv_heads, head_dim_v), draw(batch, q_len, heads, head_dim_v)
    return q, k, v, d_out, 0.1 * jnp.asarray(rng.standard_normal((batch, heads, q_len), np.float32))


def _interpreter():
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    return params


def _segments(shape, *starts):
    """Segment ids (q, kv) [batch, len] of documents packed from `starts` on."""
    batch, q_len, kv_len = shape[:3]
    return tuple(jnp.asarray(np.stack([packed_ids(n, *starts)] * batch)) for n in (q_len, kv_len))


def _key_query_bias(shape):
    """A score program closing over a float per-query temperature and a per-key bias (row and column values with
    gradients; a per-query bias would only shift the row, its gradient d_lse alone)."""
    _, q_len, kv_len = shape[:3]
    rng = np.random.default_rng(9)
    q_temp, kv_bias = (0.5 * jnp.asarray(rng.standard_normal(n), jnp.float32) for n in (q_len, kv_len))
    program, consts = mods.trace(lambda s, b, h, q, k: s * (1.0 + 0.2 * q_temp[q]) + kv_bias[k], "score")
    return program, consts


# name: (shape (batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v), kernel options, config)
FORWARD_CASES = {
    # MLA's head dims, causal, GQA, ragged; persistent CTAs: an output tile of its own beside Q and the next Q's load
    "mla_192_128_causal_persistent": (
        (2, 130, 100, 2, 1, 192, 128),
        dict(is_causal=True),
        HopperConfig(64, 64, 2, persistent=True),
    ),
    # a narrower value, q_len != kv_len, a window with segment ids, the overlapped loop
    "128_64_window_segments_overlap": (
        (1, 100, 200, 2, 2, 128, 64),
        dict(local_window_size=(90, 20), segments=(70,)),
        HopperConfig(64, 64, 2, overlap=True),
    ),
    # head_dim 80 runs at 96 (`forward_head_dim`: 64-byte swizzled tiles), value 64 at its own 128-byte ones
    "80_64_causal": ((1, 130, 100, 2, 1, 80, 64), dict(is_causal=True), HopperConfig(64, 64, 2)),
}


def _reference(q, k, v, options, score=None):
    """The float32 reference (out, lse) of a case's options, with a score program (Program, consts) or None."""
    q_ids, kv_ids = _segments(_shape(q, k, v), *options["segments"]) if "segments" in options else (None, None)
    return reference.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)),
        scale=SCALE,
        band=masks.Band.of(options.get("is_causal", False), options.get("local_window_size")),
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        score_mod=None if score is None else score[0],
        score_consts=() if score is None else score[1],
    )


def _shape(q, k, v):
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])


def _kernel_options(shape, options):
    """The kernels' band and segment-id arguments of a case's options."""
    kwargs = dict(is_causal=options.get("is_causal", False), local_window_size=options.get("local_window_size"))
    if "segments" in options:
        kwargs.update(zip(("q_segment_ids", "kv_segment_ids"), _segments(shape, *options["segments"])))
    return kwargs


# `slow` for CI time: 80_64 runs Q/K tiles at one head_dim and V, the accumulator and the output at another.
SLOW_FORWARD_CASES = {"mla_192_128_causal_persistent", "128_64_window_segments_overlap"}


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW_FORWARD_CASES else ()) for c in FORWARD_CASES]
)
def test_forward_at_value_head_dim_in_mosaic_gpu_interpreter(case):
    """The forward with Q and K tiles at query's head_dim and V, the accumulator and the output at value's matches
    the reference (out [batch, q_len, heads, head_dim_v]; zeros and lse = -inf where a row sees no key)."""
    shape, options, config = FORWARD_CASES[case]
    q, k, v, _, _ = _inputs(shape, seed=41)
    out, lse = hopper_fwd.hopper_forward(
        q, k, v, scale=SCALE, config=config, interpret=_interpreter(), **_kernel_options(shape, options)
    )
    assert not _compat.mosaic_gpu_races_found()
    ref_out, ref_lse = _reference(q, k, v, options)
    assert out.shape == ref_out.shape == (*q.shape[:3], v.shape[3])
    assert_close(out, ref_out, jnp.bfloat16)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")


# name: (shape, kernel options, config, with a score program (per-query and per-key float biases))
BACKWARD_CASES = {
    # MLA's head dims at their default tiles (the plain two passes, 2-stage rings), causal, GQA, ragged
    "mla_192_128_causal": ((1, 100, 130, 2, 1, 192, 128), dict(is_causal=True), None, False),
    # a narrower value with both overlapped loops, segment ids and q_len != kv_len
    "128_64_segments_overlap": (
        (2, 130, 70, 2, 2, 128, 64),
        dict(segments=(50,)),
        HopperBwdConfig(num_stages_dkv=3, num_stages_dq=3, dq_overlap=True, dkv_overlap=True),
        False,
    ),
    # head_dim 256 on split_columns alone (the dQ pass as calls with programs, dense tiles or dropout run it)
    "256_split_causal": (
        (1, 100, 130, 2, 1, 256, 256),
        dict(is_causal=True),
        HopperBwdConfig(split_columns=True),
        False,
    ),
    # head_dim 256 at its default: split_columns with both passes' products split (the dQ pass's S and P on one
    # consumer, dP and dS on the other, dS shared; the dK/dV pass's S^T and P^T on one, dP^T and dS^T on the other,
    # P^T and dS^T shared), causal, GQA, ragged
    "256_split_products_causal": ((1, 100, 130, 2, 1, 256, 256), dict(is_causal=True), None, False),
    # the same with value head_dim 128, segment ids and q_len > kv_len
    "256_128_split_products_segments": ((2, 130, 70, 2, 2, 256, 128), dict(segments=(50,)), None, False),
    # the same with segment ids and q_len < kv_len (key tiles with no query step)
    "256_split_products_segments": ((1, 100, 130, 2, 1, 256, 256), dict(segments=(40,)), None, False),
    # split_columns with value head_dim 128 and a score program's row and column gradients (one consumer stores)
    "256_128_split_score_program": ((1, 130, 100, 2, 1, 256, 128), dict(), None, True),
    # square 192, split into 96-column halves (64-byte swizzled tiles), causal, GQA, ragged
    "192_split_causal": ((1, 100, 130, 2, 1, 192, 192), dict(is_causal=True), None, False),
    # head_dim 80 computed at 96 (64-byte swizzled Q/K tiles), value 64, causal, GQA, ragged
    "80_64_causal": ((1, 100, 130, 2, 1, 80, 64), dict(is_causal=True), None, False),
}


# `slow` for CI time (the overlapped loops at a value head_dim of its own; MLA's dims, whose value head_dim of its
# own 80_64 covers; square 192 runs the split passes, which 256 and the lowering cover; split columns with a score
# program; the split products at a value head_dim of its own or with segment ids, which the lowering tests cover;
# split_columns' own passes, which the score-program case and the lowering tests cover; run them with -m slow):
SLOW_BACKWARD_CASES = {
    "256_split_products_segments",
    "256_128_split_products_segments",
    "256_split_causal",
    "128_64_segments_overlap",
    "mla_192_128_causal",
    "192_split_causal",
    "256_128_split_score_program",
}


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW_BACKWARD_CASES else ()) for c in BACKWARD_CASES]
)
def test_backward_at_head_dims_in_mosaic_gpu_interpreter(case):
    """Both passes from the reference's residuals (dK/dV with V and dO at value's head_dim, dQ with dP's contraction
    over it; at head_dim 256 each consumer's half of the columns): dq, dk, dv (and the score program's closed-over
    arrays' gradients) against the reference's vjp."""
    shape, options, config, with_program = BACKWARD_CASES[case]
    batch, q_len, kv_len, heads = shape[:4]
    q, k, v, d_out, d_lse = _inputs(shape, seed=42)
    score = _key_query_bias(shape) if with_program else None
    consts = () if score is None else score[1]

    def ref(q, k, v, consts):
        return _reference(q, k, v, options, None if score is None else (score[0], consts))

    (out, lse), vjp = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)), consts)
    want = vjp((d_out.astype(jnp.float32), d_lse))
    program = {}
    if score is not None:
        staged = mods.stage(score[0])[0]
        dims = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
        stacks, stacks_vjp = jax.vjp(lambda c: staged.stacks(c, **dims), consts)
        program = dict(score_mod=staged, score_stacks=stacks)
    params = _interpreter()
    dq, dk, dv, d_rows, d_cols = interpreted_hopper_backward(
        q, k, v, out.astype(q.dtype), lse, d_out, d_lse,
        scale=SCALE, config=config, interpret=params, **program, **_kernel_options(shape, options),
    )  # fmt: skip
    assert_gradients_close((dq, dk, dv), want, (q, k, v))
    if score is not None:
        cotangents = tuple(None if s is None else jnp.zeros_like(s) for s in program["score_stacks"])
        (d_consts,) = stacks_vjp((cotangents[0], d_rows, cotangents[2], d_cols))
        for i, (ours, ref_grad) in enumerate(zip(d_consts, want[3])):
            assert_close(ours, ref_grad, jnp.bfloat16, table=GRADIENT, what=f"closed-over array {i}")


# ---- lowering -----------------------------------------------------------------------------------------------

LOWERING_DIMS = [(192, 128), (128, 64), (96, 96), (256, 256), (256, 128), (192, 192)]


def _abstract(head_dims, batch=2, q_len=300, kv_len=333, heads=4, kv_heads=2):
    """Abstract bf16 (q, k, v, out) and float32 lse of a ragged GQA call at (query/key, value) head dims."""
    head_dim, head_dim_v = head_dims
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim_v), jnp.bfloat16)
    out = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim_v), jnp.bfloat16)
    return q, k, v, out, jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)


def _abstract_ids(batch=2, q_len=300, kv_len=333):
    """Abstract int32 segment ids of `_abstract`'s call, as hopper_backward's keyword arguments."""
    return dict(
        q_segment_ids=jax.ShapeDtypeStruct((batch, q_len), jnp.int32),
        kv_segment_ids=jax.ShapeDtypeStruct((batch, kv_len), jnp.int32),
    )


@pytest.mark.lowering
@pytest.mark.parametrize("schedule", ["default", "persistent", "overlap"])
@pytest.mark.parametrize("head_dims", [*LOWERING_DIMS[:3], (32, 32)], ids=lambda d: f"{d[0]}-{d[1]}")
def test_forward_at_head_dims_lowers_for_gpu(head_dims, schedule):
    """The forward at its default tiles for these head dims (and persistent, and overlapped) goes through Mosaic
    GPU's lowering, causal, ragged and GQA (96 and 32: tiles under a 64-byte swizzle, wgmma's contraction in
    32-column groups)."""
    q, k, v, _, _ = _abstract(head_dims)
    config = hopper_fwd.default_config(*head_dims[:1], 333, masks.Band.of(True, None), 0, head_dims[1])
    if schedule != "default":
        config = dataclasses.replace(config, persistent=schedule == "persistent", overlap=schedule == "overlap")

    def forward(q, k, v):
        return hopper_fwd.hopper_forward(q, k, v, scale=SCALE, is_causal=True, config=config)

    assert lower_for_cuda(forward, q, k, v).count(MOSAIC_CALL) == 1


@pytest.mark.lowering
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dims", LOWERING_DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
def test_backward_at_head_dims_lowers_for_gpu(head_dims, is_causal):
    """Both passes at their default tiles for these head dims (256: split_columns with both passes' products
    split) go through Mosaic GPU's lowering, ragged and GQA, with segment ids when causal."""
    q, k, v, out, lse = _abstract(head_dims)
    ids = _abstract_ids() if is_causal else {}

    def backward(q, k, v, out, lse, d_out, ids):
        return hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, None, scale=SCALE, is_causal=is_causal, **ids)

    assert lower_for_cuda(backward, q, k, v, out, lse, out, ids).count(MOSAIC_CALL) == 2


@pytest.mark.lowering
@pytest.mark.parametrize("split_products", [False, True])
def test_split_columns_with_a_score_program_and_dropout_lowers_for_gpu(split_products):
    """split_columns with a score program's row and column gradients (stored by one consumer) and dropout; asked
    for both passes' split products, it runs split_columns' way (they serve plain calls only)."""
    shape = (2, 300, 333, 4, 2, 256, 256)
    q, k, v, out, lse = _abstract(shape[5:])
    program, consts = _key_query_bias(shape)
    staged = mods.stage(program)[0]
    stacks = staged.stacks(consts, batch=2, heads=4, q_len=300, kv_len=333)

    config = HopperBwdConfig(split_columns=True, dq_split_products=True, dkv_split_products=True)

    def backward(q, k, v, out, lse, d_out, stacks):
        return hopper_bwd.hopper_backward(
            q, k, v, out, lse, d_out, None, scale=SCALE, score_mod=staged, score_stacks=stacks, dropout_rate=0.1,
            dropout_seed=jnp.zeros((2,), jnp.uint32), config=config if split_products else None,
        )  # fmt: skip

    assert lower_for_cuda(backward, q, k, v, out, lse, out, stacks).count(MOSAIC_CALL) == 2


# ---- configs and dispatch (CPU, nothing runs) -------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_dim, runs_at, swizzle",
    [(64, 64, 128), (80, 96, 64), (96, 96, 64), (112, 128, 128), (128, 128, 128), (160, 160, 64), (192, 192, 128)],
)
def test_forward_head_dims_and_their_swizzle(head_dim, runs_at, swizzle):
    """The forward pads head_dim to a multiple of 32 only, and tiles a row under the widest swizzle that divides
    it (its wgmma contraction groups): 96 and 160 run unpadded on 64-byte swizzles."""
    from pallas_flash.hopper.common import forward_head_dim, head_dim_transforms

    assert forward_head_dim(head_dim) == runs_at
    tiling, swizzled = head_dim_transforms(runs_at)
    assert (tiling.tiling, swizzled.swizzle) == ((8, swizzle // 2), swizzle)
    assert runs_at % (swizzle // 2) == 0


@pytest.mark.parametrize(("head_dim", "swizzle"), [(256, 128), (192, 64), (128, 128)])
def test_split_columns_tiles_each_half_under_its_own_swizzle(head_dim, swizzle):
    """With split_columns each consumer's half of a row is whole swizzle tiles: 256's halves of 128 columns under
    128 bytes, 192's of 96 under 64 (a 128-byte swizzle would cut a tile in two); the backward's config for 192
    splits there, at 192."""
    from pallas_flash.hopper.common import head_dim_transforms

    tiling, swizzled = head_dim_transforms(head_dim, split=True)
    assert (tiling.tiling, swizzled.swizzle) == ((8, swizzle // 2), swizzle)
    assert head_dim // 2 % (swizzle // 2) == 0
    if head_dim >= 192:
        assert HopperBwdConfig.default(head_dim).split_columns and HopperBwdConfig.can_split_columns(head_dim)


@pytest.mark.parametrize("head_dims", [(192, 128), (128, 64), (256, 256), (256, 128), (64, 128), (96, 96)])
def test_default_tiles_fit_at_head_dims(head_dims):
    """The default forward and backward tiles fit an H100's shared memory at these (padded) head dims; the
    backward splits the columns exactly where a consumer's dK and dV would not fit its registers (256)."""
    head_dim, head_dim_v = (-(-d // 64) * 64 for d in head_dims)
    band = masks.Band.of(True, None)
    forward = hopper_fwd.default_config(head_dim, 4096, band, 0, head_dim_v)
    assert forward.smem_bytes(head_dim, 2, 0, head_dim_v) <= H100_SHARED_MEMORY
    backward = hopper_bwd.default_config(head_dim, 4096, band, True, head_dim_v=head_dim_v)
    hopper_bwd.check_config(backward, head_dim, head_dim_v=head_dim_v)
    assert backward.split_columns == (head_dim == 256)
    assert backward.dq_split_products == backward.dkv_split_products == (head_dim == 256)


@pytest.mark.parametrize(
    ("extras", "split_products"), [({}, True), ({"programs": True}, False), ({"tile_bytes": 1}, False)]
)
def test_split_products_are_the_plain_calls_default_at_256(extras, split_products):
    """At head_dim 256 both passes share their products' tiles where a call has no program or dense tiles; with
    them they run split_columns' way, whose shared memory leaves room for a dense mask's tiles (the P and dS tiles
    would not)."""
    backward = hopper_bwd.default_config(256, 4096, masks.Band.of(True, None), True, **extras)
    assert backward is not None and backward.split_columns
    assert backward.dq_split_products == backward.dkv_split_products == split_products
    if "tile_bytes" in extras:
        assert dataclasses.replace(backward, dq_split_products=True).smem_bytes_dq(256, 2, 1) > H100_SHARED_MEMORY


@pytest.mark.parametrize(
    "head_dims, computed",
    [((192, 192), (192, 192)), ((160, 160), (192, 192)), ((192, 256), (192, 256)), ((192, 128), (192, 128)),
     ((256, 128), (256, 128)), ((96, 96), (96, 96)), ((80, 64), (96, 64)), ((112, 48), (128, 64))],
)  # fmt: skip
def test_the_backward_computes_at_head_dims_it_can_split(head_dims, computed):
    """The backward computes at the 64-element tile (192 split into 96-column halves under a 64-byte swizzle;
    160 at 192), 65-96 at 96 (64-byte swizzled tiles)."""
    assert hopper_bwd.backward_head_dims(*head_dims) == computed


def test_head_dims_without_tiles_are_refused_by_name(monkeypatch):
    """Query/key 192 with value 256: no forward tiles fit, and the Mosaic GPU implementation says so naming both head
    dims; it serves MLA's (192, 128), (128, 64), (256, 128) and square 192 (its backward split into 96-column
    halves) on sm90 (faked)."""
    with pytest.raises(ValueError, match="split_columns"):
        HopperBwdConfig(split_columns=True, dq_atomic=True)
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)

    def reason(head_dim, head_dim_v):
        q = jax.ShapeDtypeStruct((1, 1024, 2, head_dim), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((1, 1024, 2, head_dim_v), jnp.bfloat16)
        return hopper_vjp.unsupported_reason(q, q, band=masks.Band.of(True, None), config=KernelConfig(), value=v)

    assert "head_dims 192 (query, key) and 256 (value)" in reason(192, 256)
    assert all(reason(*dims) is None for dims in [(192, 128), (128, 64), (256, 128), (192, 192)])


# ---- on the GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "head_dims",
    [(192, 128), (128, 64), (256, 256), (96, 96), (80, 80), (32, 32), (192, 192)],
    ids=lambda d: f"{d[0]}-{d[1]}",
)
def test_head_dims_on_hopper(head_dims, is_causal):
    """On sm90, flash_attention(implementation="mosaic") and its gradients at MLA's head dims, at head_dim 256 (the
    Hopper backward, split_columns), 96 and 80 (both kernels at 96 on 64-byte swizzled tiles), 32 (the forward
    unpadded, the backward at 64) and square 192 (the backward split into 96-column halves), ragged, GQA, against
    the float32 reference."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    shape = (2, 333, 460, 4, 2, *head_dims)
    q, k, v, d_out, _ = _inputs(shape, seed=43)
    options = dict(scale=SCALE, is_causal=is_causal, return_lse=True)

    def run(implementation, q, k, v):
        return pf.flash_attention(q, k, v, implementation=implementation, **options)

    (out, lse), vjp = jax.vjp(lambda *x: run("mosaic", *x), q, k, v)
    (ref_out, ref_lse), ref_vjp = jax.vjp(lambda *x: run("xla", *x), *(x.astype(jnp.float32) for x in (q, k, v)))
    assert out.shape == (*q.shape[:3], v.shape[3])
    assert_close(out, ref_out, jnp.bfloat16)
    assert_close(lse, ref_lse, jnp.bfloat16, what="lse")
    grads = vjp((d_out, jnp.zeros_like(lse)))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_vjp((d_out.astype(jnp.float32), jnp.zeros_like(lse)))):
        assert_close(got, ref, jnp.bfloat16, table=GRADIENT, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(), dict(is_causal=True, segments=(150,))], ids=["full", "causal_segments"])
@pytest.mark.parametrize("head_dims", [(256, 256), (256, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
def test_split_backward_variants_on_hopper(head_dims, options):
    """On sm90, the default backward at head_dim 256 (both passes' products split) and the one with split_columns'
    own dK/dV pass (what calls with programs or dense tiles run) against the float32 reference's vjp, ragged and
    GQA."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    shape = (2, 333, 460, 4, 2, *head_dims)
    q, k, v, d_out, d_lse = _inputs(shape, seed=44)
    (out, lse), vjp = jax.vjp(lambda *x: _reference(*x, options), *(x.astype(jnp.float32) for x in (q, k, v)))
    want = vjp((d_out.astype(jnp.float32), d_lse))
    config = HopperBwdConfig(split_columns=True, dq_split_products=True)
    for chosen in (None, config):
        grads = hopper_bwd.hopper_backward(
            q, k, v, out.astype(q.dtype), lse, d_out, d_lse, scale=SCALE, config=chosen,
            **_kernel_options(shape, options),
        )  # fmt: skip
        assert_gradients_close(grads[:3], want, (q, k, v))
