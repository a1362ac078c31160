"""Score modifiers as the portable kernels run them: one case per kernel code path (the bias tile and the dbias
kernel's reductions over each broadcast axis, mask tiles and vectors, ALiBi, the soft cap's gradient factor,
dropout, with a block mask), the dbias kernel dropped when unused, the Triton lowering, and on a GPU the compiled
kernels at realistic sizes. Their semantics in every implementation are in tests/test_score_mods.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, masks
from pallas_flash._compat import TritonCompilerParams
from pallas_flash.hopper.config import H100_SHARED_MEMORY
from pallas_flash.portable import vjp as portable
from tests.conftest import has_nvidia_gpu
from tests.helpers import (
    MODIFIER_CASES,
    MODIFIER_CASES_WITH_EMPTY_ROWS,
    MODIFIER_SHAPE,
    SMALL_BLOCKS,
    check_modifiers_against_reference,
    make_inputs,
    modifier_case,
    modifier_with_block_mask_case,
    normal,
    random_mask,
)

# One case per code path of the portable kernels outside `slow` ("everything", causal, is in
# tests/test_score_mods.py: a bias tile broadcast over the batch, a mask tile with a row that sees nothing,
# ALiBi, the soft cap and dropout in one call). The dbias kernel reduces over the axes a bias broadcasts
# over: none (bias_full), batch and queries (bias_heads_keys, with a block mask below), heads and keys
# (dropout_bias with a block mask), batch and heads in bfloat16 (bias_rank2_bf16). Mask vectors, per-example
# ALiBi slopes, a soft cap and broadcast dropout: mask_keys_alibi_soft_cap_broadcast_dropout.
CODE_PATHS = {
    "bias_full": (False, modifier_case("bias_full", (1, 37, 45, 2, 1, 16))),
    "bias_rank2_bf16": (True, modifier_case("bias_rank2_bf16", MODIFIER_SHAPE)),
    "mask_keys_alibi_soft_cap_broadcast_dropout": (
        False,
        dict(
            modifier_case("mask_keys", MODIFIER_SHAPE),
            **modifier_case("alibi_per_example_soft_cap", MODIFIER_SHAPE),
            **modifier_case("dropout_broadcast", MODIFIER_SHAPE),
        ),
    ),
}


@pytest.mark.parametrize("path", list(CODE_PATHS))
def test_modifier_code_path_against_reference(path):
    is_causal, kwargs = CODE_PATHS[path]
    shape = (1, 37, 45, 2, 1, 16) if path == "bias_full" else MODIFIER_SHAPE
    check_modifiers_against_reference("pallas", shape, jnp.float32, is_causal, kwargs, SMALL_BLOCKS)


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", MODIFIER_CASES)
def test_every_modifier_case(case, is_causal):
    """The XLA chunked grid of tests/test_score_mods.py on the portable kernels."""
    empty = check_modifiers_against_reference(
        "pallas", MODIFIER_SHAPE, jnp.float32, is_causal, modifier_case(case, MODIFIER_SHAPE), SMALL_BLOCKS
    )
    if case in MODIFIER_CASES_WITH_EMPTY_ROWS:
        assert empty.any(), "this case is meant to contain fully masked rows"


@pytest.mark.parametrize(
    "case, is_causal", [("bias_heads_keys", True), ("mask", False), ("dropout_bias", False)], ids=str
)
def test_modifiers_with_block_mask(case, is_causal):
    """A BlockMask and score modifiers in one call: the visit tables skip hidden tiles in the forward, dK/dV,
    dQ and dbias kernels (dbias sums dS over query blocks: the hidden tiles must add nothing)."""
    empty = check_modifiers_against_reference(
        "pallas",
        MODIFIER_SHAPE,
        jnp.float32,
        is_causal,
        modifier_with_block_mask_case(case, MODIFIER_SHAPE),
        SMALL_BLOCKS,
    )
    assert empty.any(), "the block mask hides a whole query block of head 0"


def test_dropout_lse_is_the_undropped_one():
    q, k, v, _ = make_inputs((1, 20, 30, 2, 1, 16), jnp.float32, seed=55)
    _, lse = pf.flash_attention(q, k, v, return_lse=True, implementation="pallas", config=SMALL_BLOCKS)
    _, lse_dropped = pf.flash_attention(
        q,
        k,
        v,
        return_lse=True,
        implementation="pallas",
        config=SMALL_BLOCKS,
        dropout_rate=0.5,
        dropout_rng=jax.random.key(0),
    )
    # Not bit-equal: the modifier path scales the logits in two multiplies (scale, then log2(e)).
    np.testing.assert_allclose(lse, lse_dropped, rtol=1e-6)


# ---- the dbias kernel is dropped when unused ------------------------------------------------------------------


def _while_loops(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text().count(" while(")


@pytest.mark.skipif(has_nvidia_gpu(), reason="counts interpret mode's while loops; compiled kernels are custom calls")
def test_dbias_kernel_is_dead_code_without_a_bias_cotangent():
    """In interpret mode each pallas_call is a while loop over its grid: differentiating only in q must
    compile one loop fewer than differentiating in q and the bias."""
    q, k, v, _ = make_inputs((1, 20, 20, 2, 2, 16), jnp.float32, seed=56)
    bias = normal(57, (1, 2, 20, 20))

    def loss(q, bias):
        return jnp.sum(pf.flash_attention(q, k, v, bias=bias, implementation="pallas", config=SMALL_BLOCKS))

    only_q = _while_loops(jax.grad(loss, argnums=0), q, bias)
    with_bias = _while_loops(jax.grad(loss, argnums=(0, 1)), q, bias)
    assert only_q < with_bias, (only_q, with_bias)


@pytest.mark.lowering
@pytest.mark.skipif(TritonCompilerParams is None, reason="this JAX has no Pallas Triton lowering")
def test_kernels_with_modifiers_and_block_mask_lower_to_triton_for_cuda():
    """Forward, dK/dV, dQ and dbias with a bias, dropout and a per-head block mask, lowered for CUDA on this
    machine (Pallas's Triton lowering runs without a GPU), so that what it rejects fails in CI."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = 2, 256, 200, 4, 2, 64
    block_mask = pf.BlockMask(np.random.default_rng(80).random((1, heads, 4, 4)) < 0.5, 64, 64)
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, heads, 1, kv_len), jnp.float32)
    mods = masks.ScoreMods(bias_dims=(False, True, False, True), dropout_rate=0.1)

    def fwd_bwd(q, k, v, bias):  # the kernels' own entry point: flash_attention would pick interpret mode here
        fn = lambda q, k, v, bias: portable.flash_attention_portable(
            q,
            k,
            v,
            scale=0.1,
            band=masks.Band.of(True),
            config=pf.KernelConfig.default(head_dim),
            interpret=False,
            block_mask=block_mask,
            mods=mods,
            mod_arrays=masks.ModArrays(bias=bias, dropout_seed=jnp.array([1, 2], jnp.uint32)),
        )
        out, vjp = jax.vjp(fn, q, k, v, bias)
        return vjp(out)

    triton = "__gpu$xla.gpu.triton"
    with _compat.lowering_gpu():
        exported = jax.export.export(
            jax.jit(fwd_bwd), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
        )(q, k, k, bias)
    assert exported.mlir_module().count(f"stablehlo.custom_call @{triton}") == 4


# ---- GPU: the compiled kernels at realistic sizes ---------------------------------------------------------------


def _gpu_case(name, shape):
    batch, q_len, kv_len, heads, _, _ = shape
    return {
        "bias_mask": dict(
            bias=normal(60, (batch, heads, q_len, kv_len)),
            mask=random_mask(61, (batch, 1, q_len, kv_len), 0.2).at[:, :, 7, :].set(False),
        ),
        "broadcast_bias_alibi_cap": dict(
            bias=normal(62, (1, heads, 1, kv_len)), logits_soft_cap=5.0, alibi_slopes=jnp.geomspace(0.25, 0.004, heads)
        ),
        "dropout_everything": dict(
            bias=normal(63, (batch, 1, q_len, kv_len)),
            mask=random_mask(64, (1, 1, 1, kv_len)),
            alibi_slopes=jnp.geomspace(0.25, 0.004, heads),
            logits_soft_cap=5.0,
            dropout_rate=0.1,
            dropout_rng=jax.random.key(65),
        ),
    }[name]


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", ["bias_mask", "broadcast_bias_alibi_cap", "dropout_everything"])
@pytest.mark.parametrize(
    "shape", [(2, 1000, 1000, 4, 2, 64), (1, 2048, 1531, 4, 4, 128)], ids=lambda s: "x".join(map(str, s))
)
def test_gpu_modifiers_default_blocks(shape, case, dtype, is_causal):
    check_modifiers_against_reference("pallas", shape, dtype, is_causal, _gpu_case(case, shape), None, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_bias_shared_over_batch_head_dim_128(is_causal):
    """A bias shared by the batch ([1, heads, q, k]) makes the dbias kernel loop over the batch, and Triton
    pipelines that loop's Q, dO, K and V loads: at head_dim 128 its stages must fit shared memory."""
    shape = (2, 1024, 1024, 4, 4, 128)
    case = dict(bias=normal(66, (1, shape[3], shape[1], shape[2])).astype(jnp.bfloat16))
    check_modifiers_against_reference("pallas", shape, jnp.bfloat16, is_causal, case, None, seed=4)


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16, None])
@pytest.mark.parametrize("mask_spans_queries", [True, False])
def test_default_tiles_leave_room_for_bias_and_mask_tiles(bias_dtype, mask_spans_queries):
    """A bias or mask spanning queries and keys is streamed as a [block_q, block_kv] tile beside K and V; at
    head_dim 128 in bf16 the tuned tiles alone nearly fill an H100's shared memory, so the default config
    must shrink (Triton refused the unshrunk tiles with a float32 bias on the H100, 2026-11-23)."""
    batch, q_len, kv_len, heads = 1, 256, 256, 4
    q = jnp.zeros((batch, q_len, heads, 128), jnp.bfloat16)
    bias = None if bias_dtype is None else jnp.zeros((batch, heads, q_len, kv_len), bias_dtype)
    mask = jnp.ones((batch, 1, q_len if mask_spans_queries else 1, kv_len), bool)
    mods, mod_arrays = pf.api._score_mods(q, q, bias, mask, None, None, 0.0, None, False)
    tile_bytes = pf.api._score_tile_bytes(mods, mod_arrays)
    expected = (0 if bias_dtype is None else jnp.dtype(bias_dtype).itemsize) + (1 if mask_spans_queries else 0)
    assert tile_bytes == expected
    config = pf.KernelConfig.default(128, 2, H100_SHARED_MEMORY, tile_bytes)
    needed = config.shared_memory(128, 2, tile_bytes)
    assert max(needed.values()) <= H100_SHARED_MEMORY
    if tile_bytes:
        assert config != pf.KernelConfig.default(128, 2)
