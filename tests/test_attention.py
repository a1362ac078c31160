"""The shared correctness grid: every implementation against the float32 dense reference.

On CPU "pallas" runs the kernels in Pallas interpret mode (small shapes, small blocks so that every loop,
diagonal tile and ragged tail is exercised); on an NVIDIA GPU the same grid runs the compiled kernels, and
the tests marked `gpu` add realistic shapes and the default block sizes.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from tests.tolerances import GRADIENT, OUTPUT, assert_close

SMALL_BLOCKS = pf.KernelConfig(block_q=16, block_kv=16, block_q_dkv=16, block_kv_dkv=32, block_q_dq=32,
                               block_kv_dq=16, xla_block_kv=16)

# (batch, q_len, kv_len, heads, kv_heads, head_dim): ragged lengths, q_len != kv_len both ways, MHA/GQA/MQA,
# a non-power-of-two head_dim, single-row queries and keys.
SHAPES = [
    (2, 50, 70, 4, 2, 32),
    (1, 70, 37, 3, 1, 80),
    (2, 1, 45, 2, 2, 16),
    (1, 45, 1, 2, 1, 16),
    (1, 130, 130, 2, 2, 64),
]
IMPLEMENTATIONS = ["pallas", "xla_chunked"]


def make_inputs(shape, dtype, seed):
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(kg, (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v, cotangent


def reference(q, k, v, *, is_causal, scale=None):
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return pf.attention_reference(*f32, scale=scale, is_causal=is_causal)


def check_against_reference(impl, shape, dtype, is_causal, config, seed=0):
    q, k, v, cotangent = make_inputs(shape, dtype, seed)
    attend = functools.partial(pf.flash_attention, is_causal=is_causal, implementation=impl, config=config)
    out, lse = attend(q, k, v, return_lse=True)
    ref_out, ref_lse = reference(q, k, v, is_causal=is_causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (shape[0], shape[3], shape[1])
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, jnp.float32, what="lse")

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32))

    grads = jax.grad(functools.partial(loss, attend), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, lambda *a: reference(*a, is_causal=is_causal)[0]),
                         argnums=(0, 1, 2))(*[x.astype(jnp.float32) for x in (q, k, v)])
    for name, g, rg, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, rg, dtype, table=GRADIENT, what=f"d{name}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_float32(impl, shape, is_causal):
    check_against_reference(impl, shape, jnp.float32, is_causal, SMALL_BLOCKS)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_low_precision(impl, dtype, is_causal):
    check_against_reference(impl, (2, 50, 70, 4, 2, 32), dtype, is_causal, SMALL_BLOCKS, seed=1)


GPU_SHAPES = [(2, 1000, 1000, 8, 8, 64), (1, 777, 1531, 8, 2, 128), (1, 1531, 513, 4, 1, 96),
              (2, 256, 256, 4, 4, 256), (1, 2048, 2048, 4, 4, 128)]


def _gpu_grid(dtypes, slow_float32=True):
    """(shape, dtype) params; float32 runs on Triton's FMA path and compiles for minutes at these sizes,
    so only the first shape's float32 case is in the default GPU run."""
    params = []
    for i, shape in enumerate(GPU_SHAPES):
        for dtype, name in dtypes:
            marks = [pytest.mark.slow] if slow_float32 and dtype == jnp.float32 and i else []
            params.append(pytest.param(shape, dtype, marks=marks, id=f"{'x'.join(map(str, shape))}-{name}"))
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape,dtype", _gpu_grid([(jnp.float32, "fp32"), (jnp.bfloat16, "bf16"),
                                                   (jnp.float16, "fp16")]))
def test_gpu_default_blocks(shape, dtype, is_causal):
    check_against_reference("pallas", shape, dtype, is_causal, None, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape,dtype", _gpu_grid([(jnp.bfloat16, "bf16"), (jnp.float16, "fp16")]))
def test_gpu_mosaic(shape, dtype, is_causal):
    """The Hopper forward (with the portable backward) through the same grid; skipped off sm90."""
    from pallas_flash.kernels import hopper
    if not hopper.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    check_against_reference("mosaic", shape, dtype, is_causal, None, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape,dtype", _gpu_grid([(jnp.bfloat16, "bf16")]))
def test_gpu_mosaic_overlap(shape, dtype, is_causal, persistent):
    """`HopperConfig.overlap` (FA3's intra-warpgroup pipelining) on the GPU grid; skipped off sm90."""
    from pallas_flash.config import HopperConfig, KernelConfig
    from pallas_flash.kernels import hopper, hopper_fwd
    if not hopper.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    head_dim = hopper_fwd.padded_head_dim(shape[-1])
    block_kv = 64 if head_dim > 128 else 128
    # The portable backward keeps its tuned tiles (KernelConfig()'s do not fit shared memory at head_dim 256).
    config = dataclasses.replace(KernelConfig.default(shape[-1]),
                                 hopper=HopperConfig(64, block_kv, 2, persistent, overlap=True))
    check_against_reference("mosaic", shape, dtype, is_causal, config, seed=2)


@pytest.mark.parametrize("head_dim, kv_len, is_causal, window, overlap", [
    (128, 2048, False, None, True), (128, 16384, True, None, True), (128, None, False, None, True),
    (128, 1024, False, None, False),  # short rows: no overlap (unmeasured with it)
    (128, 2048, False, (300, 77), True), (128, 4096, False, (None, 0), True),  # windows: as unmasked calls
    (64, 8192, False, None, False)])
def test_hopper_default_overlaps_only_where_measured(head_dim, kv_len, is_causal, window, overlap):
    """The forward default turns FA3's overlap on at head_dim 128 past 1k keys, windowed calls included (their
    GPU mask tests pass with it), and keeps head_dim 64 (slower with it) on the ping-pong."""
    from pallas_flash import masks
    from pallas_flash.kernels import hopper_fwd
    config = hopper_fwd.default_config(head_dim, kv_len, masks.Band.of(is_causal, window))
    assert config.overlap == overlap
    if overlap:
        assert (config.block_kv, config.persistent) == (128, False)


def test_hopper_default_tiles_at_head_dim_64():
    """head_dim 64: causal rows up to 1k on 128-key blocks, 3 stages, persistent; longer causal rows (2k
    measured 1.040x cuDNN on 256-key blocks against 0.989x on 128) on 256-key blocks, persistent up to 8k."""
    from pallas_flash.config import HopperConfig
    assert HopperConfig.default(64, 1024, True) == HopperConfig(64, 128, 3, True)
    assert HopperConfig.default(64, 2048, True) == HopperConfig(64, 256, 2, True)
    assert HopperConfig.default(64, 8193, True) == HopperConfig(64, 256, 2, False)


@pytest.mark.parametrize("pairs, num_q_tiles, chunk, max_ctas", [
    (1, 1, 1, 132), (3, 7, 2, 2), (17, 3, 5, 7), (16, 16, 16, 132), (5, 16, 2, 3), (32, 128, 2, 132)])
def test_persistent_order_runs_every_tile_once_in_balanced_pairs(pairs, num_q_tiles, chunk, max_ctas):
    """The persistent Hopper forward's static split: every (pair, tile) exactly once over all CTAs, and
    under a causal band (a tile of rank r visits T - r blocks) no CTA more than one (long, short) unit
    (T + 1 blocks) above the mean."""
    from pallas_flash.kernels.hopper_fwd import persistent_order, persistent_split
    ctas, num_tiles_of = persistent_split(pairs * num_q_tiles, max_ctas)
    seen, blocks = [], []
    for cta in range(ctas):
        owned = [2 * (cta + (i // 2) * ctas) + i % 2 for i in range(int(num_tiles_of(np.int32(cta))))]
        pair, rank = persistent_order(np.asarray(owned, np.int32), pairs=pairs, chunk=chunk,
                                      num_q_tiles=num_q_tiles)
        seen += list(zip(np.asarray(pair).tolist(), np.asarray(rank).tolist()))
        blocks.append(int(np.sum(num_q_tiles - np.asarray(rank))))
    assert sorted(seen) == [(p, r) for p in range(pairs) for r in range(num_q_tiles)]
    assert max(blocks) <= np.mean(blocks) + num_q_tiles + 1


def run_in_mosaic_gpu_interpreter(shape, *, is_causal=False, window=None, num_stages=2, persistent=True,
                                  q_ids=None, kv_ids=None, overlap=False):
    """The Hopper forward on bf16 inputs in JAX's Mosaic GPU interpreter with race detection, checked against
    the reference (zeros and lse = -inf where a row sees no key). Returns whether each row's lse is finite."""
    from pallas_flash import _compat, masks
    from pallas_flash.config import HopperConfig
    from pallas_flash.kernels import hopper_fwd
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=14)
    ids = {} if q_ids is None else dict(q_segment_ids=jnp.asarray(q_ids, jnp.int32),
                                       kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=0.125, is_causal=is_causal, local_window_size=window,
                                         config=HopperConfig(64, 64, num_stages, persistent, overlap),
                                         interpret=params,
                                         **ids)
    assert not _compat.mosaic_gpu_races_found()
    ref_out, ref_lse = pf.attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), scale=0.125,
                                              band=masks.Band.of(is_causal, window), **ids)
    assert_close(out, ref_out, jnp.bfloat16)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    np.testing.assert_array_equal(np.asarray(out)[~finite.transpose(0, 2, 1)], 0)
    return finite


@pytest.mark.parametrize("shape, is_causal, window, num_stages, persistent", [
    ((1, 200, 130, 2, 1, 64), False, None, 2, True),  # ragged keys: the masked tail block; 3 blocks a tile
    ((1, 130, 200, 2, 1, 64), True, None, 3, True),   # diagonal blocks, reversed tile order, 6 blocks a CTA
    ((1, 130, 200, 2, 1, 64), True, None, 2, False),  # the same, one CTA per tile
    ((1, 150, 150, 1, 1, 64), False, (40, 10), 2, True),  # both band edges, skipped blocks
    ((1, 256, 64, 1, 1, 64), False, (20, None), 2, True),  # query tiles past every key: one fully masked block
], ids=["ragged", "causal", "causal_per_tile_ctas", "window", "empty_tiles"])
def test_hopper_forward_in_mosaic_gpu_interpreter(shape, is_causal, window, num_stages, persistent):
    """The Hopper forward (barriers, TMA rings, ping-pong schedule, band ranges, masks) in JAX's Mosaic GPU
    CPU interpreter with race detection, against the reference. The interpreter cannot run wgmma on a
    transposed shared-memory ref or a register operand, so there the two matmuls are plain dots on the same
    shared-memory tiles (`interpreting` in the kernel); everything else is the kernel that runs on the GPU.
    Persistent: two CTAs, each running several query tiles, whose K/V ring slots and barrier phases carry
    over from one tile to the next (block counts per tile that are not multiples of the ring depth catch a
    ring that restarts per tile: it hangs or reads the wrong block). Segment ids: the sibling test below."""
    finite = run_in_mosaic_gpu_interpreter(shape, is_causal=is_causal, window=window, num_stages=num_stages,
                                           persistent=persistent)
    if window == (20, None):
        assert (~finite).any(), "this case is meant to contain rows that see no key"


@pytest.mark.parametrize("case", ["ragged", "causal", "causal_per_tile_ctas", "window", "empty_tiles", "packed",
                                  "no_key"])
def test_overlapped_hopper_forward_in_mosaic_gpu_interpreter(case):
    """`HopperConfig.overlap` (S_j issued before P_{j-1} V_{j-1}, block j's softmax under that P V; the first
    block peeled off and masked; V slots released a step later) on the cases above, in the interpreter."""
    band_cases = {"ragged": ((1, 200, 130, 2, 1, 64), False, None, 2, True),
                  "causal": ((1, 130, 200, 2, 1, 64), True, None, 3, True),
                  "causal_per_tile_ctas": ((1, 130, 200, 2, 1, 64), True, None, 2, False),
                  "window": ((1, 150, 150, 1, 1, 64), False, (40, 10), 2, True),
                  "empty_tiles": ((1, 256, 64, 1, 1, 64), False, (20, None), 2, True)}
    if case in band_cases:
        shape, is_causal, window, num_stages, persistent = band_cases[case]
        run_in_mosaic_gpu_interpreter(shape, is_causal=is_causal, window=window, num_stages=num_stages,
                                      persistent=persistent, overlap=True)
    else:
        shape, is_causal, q_ids, kv_ids = _segment_case(case)
        run_in_mosaic_gpu_interpreter(shape, is_causal=is_causal, q_ids=q_ids, kv_ids=kv_ids, overlap=True)


@pytest.mark.parametrize("head_dim, block_kv", [(64, 128), (128, 128), (256, 64)])
@pytest.mark.parametrize("is_causal, segments, persistent", [(False, False, False), (True, False, True),
                                                             (False, True, False)])
def test_overlapped_hopper_forward_lowers_for_gpu(head_dim, block_kv, is_causal, segments, persistent):
    """`HopperConfig.overlap` goes through Mosaic GPU's lowering (wgmma on a register operand while another
    group is in flight, the partial wait), ragged and GQA, with the masked/unmasked loop split; the kernel
    carries the name a profile shows."""
    from pallas_flash.config import HopperConfig
    from pallas_flash.kernels import hopper_fwd
    q = jax.ShapeDtypeStruct((2, 300, 4, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 333, 2, head_dim), jnp.bfloat16)
    ids = ((jax.ShapeDtypeStruct((2, 300), jnp.int32), jax.ShapeDtypeStruct((2, 333), jnp.int32)) if segments
           else (None, None))
    config = HopperConfig(64, block_kv, 2, persistent, overlap=True)

    def forward(q, k, v, q_ids, kv_ids):
        return hopper_fwd.hopper_forward(q, k, v, scale=0.1, is_causal=is_causal, q_segment_ids=q_ids,
                                         kv_segment_ids=kv_ids, config=config)

    text = jax.jit(forward).trace(q, k, k, *ids).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "flash_forward_sm90" in text


def packed_ids(length: int, *starts: int):
    """int32 [length] ids of documents packed back to back: id i from starts[i - 1] (sorted) on."""
    return np.searchsorted(np.asarray(starts), np.arange(length), side="right").astype(np.int32)


def _length_ids(lengths, length, padding_id):
    from pallas_flash import masks
    return masks.segments_from_lengths(None, jnp.asarray(lengths), length, padding_id)


def _segment_case(name):
    """(shape, is_causal, q_ids, kv_ids) of the segment-id cases; tiles are 128 query rows, key blocks 64."""
    from pallas_flash import masks
    if name == "packed":  # example 0: five documents, several per tile; 1: one document over tile 0's
        ids = np.stack([packed_ids(150, 20, 37, 90, 101), packed_ids(150, 140)])  # keys 0-127 (unmasked run)
        return (2, 150, 150, 1, 1, 64), False, ids, ids
    if name == "lengths":  # per-example lengths as padding ids (as `api._segments` folds them); GQA
        return ((2, 100, 150, 2, 1, 64), False, _length_ids([100, 37], 100, masks.QUERY_PADDING_ID),
                _length_ids([60, 150], 150, masks.KEY_PADDING_ID))
    if name == "no_key":  # document 9 has no keys: rows 80-89 of tile 0, and all of tile 1 (visits no block)
        q_ids = packed_ids(256, 40, 100)
        q_ids[80:90] = q_ids[128:] = 9
        return (1, 256, 130, 1, 1, 64), False, q_ids[None], packed_ids(130, 40, 100)[None]
    assert name == "causal"
    ids = packed_ids(200, 20, 137)[None]
    return (1, 200, 200, 2, 1, 64), True, ids, ids


@pytest.mark.parametrize("name, num_stages, persistent", [
    ("packed", 2, True), ("lengths", 2, False), ("no_key", 2, True), ("causal", 3, True)])
def test_hopper_forward_segments_in_mosaic_gpu_interpreter(name, num_stages, persistent):
    """Segment ids in the interpreter: the tile's block range from `segment_block_ranges` (read as scalars
    from global memory), the key ids riding the K ring, the id mask, the unmasked same-segment run, rows
    and whole tiles that see no key (zeros, lse = -inf), and segments under a causal band."""
    shape, is_causal, q_ids, kv_ids = _segment_case(name)
    finite = run_in_mosaic_gpu_interpreter(shape, is_causal=is_causal, num_stages=num_stages,
                                           persistent=persistent, q_ids=q_ids, kv_ids=kv_ids)
    if name in ("lengths", "no_key"):
        assert (~finite).any(), "this case is meant to contain rows that see no key"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_lse_combines_key_halves(impl, is_causal):
    """Split-KV: partial results over two key slices, weighted by exp(lse_i - lse), give the full result."""
    q, k, v, _ = make_inputs((1, 40, 64, 2, 1, 32), jnp.float32, seed=3)
    attend = functools.partial(pf.flash_attention, return_lse=True, implementation=impl, config=SMALL_BLOCKS)
    full, full_lse = attend(q, k, v)
    # Non-causal halves; for causal, only the first half is causal-relevant to early rows, so use the
    # causal mask on the whole and check the identity on the non-causal split instead.
    first, lse1 = attend(q, k[:, :30], v[:, :30])
    second, lse2 = attend(q, k[:, 30:], v[:, 30:])
    lse = jnp.logaddexp(lse1, lse2)
    weight = lambda part_lse: jnp.exp(part_lse - lse).transpose(0, 2, 1)[..., None]  # [b, q, h, 1]
    combined = weight(lse1) * first + weight(lse2) * second
    assert_close(lse, full_lse, jnp.float32, what="lse")
    assert_close(combined, full, jnp.float32)
    if is_causal:  # the causal result is reached too when the halves are themselves causal-masked
        causal_full = pf.flash_attention(q, k, v, is_causal=True, implementation=impl, config=SMALL_BLOCKS)
        ref = reference(q, k, v, is_causal=True)[0]
        assert_close(causal_full, ref, jnp.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradient_through_lse(impl):
    q, k, v, _ = make_inputs((1, 33, 47, 2, 2, 16), jnp.float32, seed=4)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse))

    ours = functools.partial(pf.flash_attention, is_causal=True, return_lse=True, implementation=impl,
                             config=SMALL_BLOCKS)
    ref = functools.partial(reference, is_causal=True)
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT)


def test_custom_scale():
    q, k, v, _ = make_inputs((1, 20, 20, 2, 2, 16), jnp.float32, seed=5)
    out = pf.flash_attention(q, k, v, scale=0.37, is_causal=True, implementation="pallas", config=SMALL_BLOCKS)
    assert_close(out, reference(q, k, v, is_causal=True, scale=0.37)[0], jnp.float32)
