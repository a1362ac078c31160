"""The shared correctness grid: every implementation against the float32 dense reference.

On CPU "pallas" runs the portable kernels in Pallas interpret mode (small shapes, small blocks so that every
loop, diagonal tile and ragged tail is exercised); on an NVIDIA GPU the same grid runs the compiled kernels, and
the tests marked `gpu` add realistic shapes, the default block sizes and the Hopper kernels ("mosaic").
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
from pallas_flash import device
from tests.helpers import SMALL_BLOCKS, check_against_reference, make_inputs, reference, shape_id
from tests.tolerances import GRADIENT, assert_close

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
# The portable kernels' grid outside `slow` (each case is an interpret-mode compile of three kernels): the
# first shape (several blocks each way, ragged, GQA) causal and not, and the edge shapes once each, with the
# causality their feature needs (single-row queries see every key unmasked; a single key is on the diagonal of
# every causal row). The 130-row shape (more blocks of the same kind) is `slow` there.
PALLAS_FAST = {(SHAPES[0], False), (SHAPES[0], True), (SHAPES[1], True), (SHAPES[2], False), (SHAPES[3], True)}


def _grid(cases, fast):
    """pytest params of (case, is_causal, impl): every case on every implementation; the portable kernels'
    cases outside `fast` are `slow`."""
    return [
        pytest.param(
            case,
            is_causal,
            impl,
            id=f"{shape_id(case) if isinstance(case, tuple) else case}-{is_causal}-{impl}",
            marks=() if impl != "pallas" or (case, is_causal) in fast else pytest.mark.slow,
        )
        for case in cases
        for is_causal in (False, True)
        for impl in IMPLEMENTATIONS
    ]


@pytest.mark.parametrize("shape, is_causal, impl", _grid(SHAPES, PALLAS_FAST))
def test_shapes_float32(impl, shape, is_causal):
    check_against_reference(impl, shape, jnp.float32, is_causal, SMALL_BLOCKS)


@pytest.mark.parametrize("dtype, is_causal, impl", _grid(["bf16", "fp16"], {("bf16", True), ("fp16", False)}))
def test_low_precision(impl, dtype, is_causal):
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    check_against_reference(impl, (2, 50, 70, 4, 2, 32), dtype, is_causal, SMALL_BLOCKS, seed=1)


@pytest.mark.parametrize(
    "is_causal, impl",
    [
        (False, "pallas"),
        (False, "xla_chunked"),
        (True, "xla_chunked"),
        pytest.param(True, "pallas", marks=pytest.mark.slow),
    ],
)
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

    ours = functools.partial(
        pf.flash_attention, is_causal=True, return_lse=True, implementation=impl, config=SMALL_BLOCKS
    )
    ref = functools.partial(reference, is_causal=True)
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_custom_scale(impl):
    q, k, v, _ = make_inputs((1, 20, 20, 2, 2, 16), jnp.float32, seed=5)
    out = pf.flash_attention(q, k, v, scale=0.37, is_causal=True, implementation=impl, config=SMALL_BLOCKS)
    assert_close(out, reference(q, k, v, is_causal=True, scale=0.37)[0], jnp.float32)


# ---- GPU: the compiled kernels at realistic sizes -------------------------------------------------------------

GPU_SHAPES = [
    (2, 1000, 1000, 8, 8, 64),
    (1, 777, 1531, 8, 2, 128),
    (1, 1531, 513, 4, 1, 96),
    (2, 256, 256, 4, 4, 256),
    (1, 2048, 2048, 4, 4, 128),
]


def gpu_grid(dtypes, slow_float32=True):
    """(shape, dtype) params; float32 runs on Triton's FMA path and compiles for minutes at these sizes,
    so only the first shape's float32 case is in the default GPU run."""
    params = []
    for i, shape in enumerate(GPU_SHAPES):
        for dtype, name in dtypes:
            marks = [pytest.mark.slow] if slow_float32 and dtype == jnp.float32 and i else []
            params.append(pytest.param(shape, dtype, marks=marks, id=f"{shape_id(shape)}-{name}"))
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "shape,dtype", gpu_grid([(jnp.float32, "fp32"), (jnp.bfloat16, "bf16"), (jnp.float16, "fp16")])
)
def test_gpu_default_blocks(shape, dtype, is_causal):
    check_against_reference("pallas", shape, dtype, is_causal, None, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape,dtype", gpu_grid([(jnp.bfloat16, "bf16"), (jnp.float16, "fp16")]))
def test_gpu_mosaic(shape, dtype, is_causal):
    """The Hopper forward and its backward (the portable one past head_dim 128) through the same grid;
    skipped off sm90."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    check_against_reference("mosaic", shape, dtype, is_causal, None, seed=2)
