"""The Hopper backward (`pallas_flash/hopper/bwd*.py`): on CPU the vmap folding and the wgmma grouping of its
dK/dV kernels; on sm90 its gradients against the float32 reference, alone and through `jax.grad` of
`flash_attention(implementation="mosaic")`. Its config, the ordered one pass, the interpreter runs and the
lowering are in their own modules."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import device, masks, reference
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.common import padded_head_dim
from pallas_flash.hopper.config import HopperBwdConfig
from tests.helpers import HOPPER_BACKWARD_VARIANTS, make_backward_inputs
from tests.tolerances import GRADIENT, assert_close

# (batch, q_len, kv_len, heads, kv_heads, head_dim)
GPU_GRID = [
    (1, 256, 256, 2, 2, 64),
    (2, 1000, 1000, 4, 2, 128),
    (1, 777, 1531, 4, 1, 64),
    (1, 1531, 513, 4, 4, 128),
    (1, 300, 300, 2, 2, 96),
]


def needs_hopper():
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")


@pytest.mark.parametrize("in_axes", [0, (0, None, 0), (None, 1, 0)])
def test_fold_vmap_matches_per_example_calls(in_axes):
    """`_fold_vmap` runs a vmapped call as one call on the batch axis folded with the vmapped one
    (unbatched arguments broadcast, None arguments kept), nested vmaps included."""
    calls = []

    def per_example(a, none, b, c):  # examples along axis 0 are independent; b is [batch, 3]
        assert none is None
        calls.append(a.shape)
        return a * b.sum(axis=-1, keepdims=True) + c, jnp.cumsum(a, axis=1)

    fn = hopper_bwd._fold_vmap(per_example)
    a, b, c = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(4, 2, 5), (4, 2, 3), (4, 2, 5)]))
    shared_a, shared_b = in_axes == (None, 1, 0), in_axes == (0, None, 0)
    a_in = a[0] if shared_a else a
    b_in = b[0] if shared_b else (jnp.swapaxes(b, 0, 1) if shared_a else b)
    got = jax.vmap(lambda a, b, c: fn(a, None, b, c), in_axes=in_axes)(a_in, b_in, c)
    for i in range(4):
        expected = per_example(a[0] if shared_a else a[i], None, b[0] if shared_b else b[i], c[i])
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g[i], e, rtol=1e-5, atol=1e-6)
    assert (8, 5) in calls, f"the vmapped call was not folded into one: {calls}"
    nested = jax.vmap(jax.vmap(lambda a: fn(a, None, a[..., :3], a)))(a.reshape(2, 2, 2, 5))
    np.testing.assert_allclose(nested[1].reshape(4, 2, 5), jnp.cumsum(a, axis=2), rtol=1e-5, atol=1e-6)


def _largest_wgmma_group(jaxpr_text: str) -> int:
    """The most wgmmas issued in one innermost `{ lambda ... }` block of a printed jaxpr: a wgmma group
    (`pl.run_scoped` / `pl.run_state` bodies hold one group each)."""
    largest, stack = 0, []
    for line in jaxpr_text.splitlines():
        stack.extend([0] * line.count("{ lambda"))
        if stack:
            stack[-1] += line.count("wgmma_ref")
        for _ in range(min(line.count(" in ("), len(stack))):
            largest = max(largest, stack.pop())
    return largest


@pytest.mark.parametrize("dq_atomic, dq_ordered", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_wgmma_order_only_for_the_ordered_one_pass_on_a_full_band(dq_atomic, dq_ordered, is_causal):
    """The dK/dV kernels issue dP^T with S^T and then dV, dK, dQ as one group (3 wgmmas) only in the ordered
    one pass on a full band, where it measured faster; elsewhere S^T alone, then dV with dP^T, then dK (and
    dQ): groups of at most 2 (`_dkdv_kernel`'s `fused`)."""
    shape = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    config = dataclasses.replace(HopperBwdConfig.default(64), dq_atomic=dq_atomic, dq_ordered=dq_ordered)
    text = str(
        jax.make_jaxpr(functools.partial(hopper_bwd.hopper_backward, scale=0.125, is_causal=is_causal, config=config))(
            shape, shape, shape, shape, lse, shape, None
        )
    )
    assert "wgmma_ref" in text
    assert _largest_wgmma_group(text) == (3 if dq_ordered and not is_causal else 2)


@pytest.mark.parametrize("portable", [False, True])
def test_the_backward_after_the_hopper_forward(portable):
    """jax.grad of the Hopper attention runs the Mosaic GPU forward, then the Hopper backward's kernels, or
    with `HopperBwdConfig(portable=True)` the portable backward's two Pallas kernels (dK/dV, dQ) on the same
    residuals. (Traced, not lowered: JAX 0.12 lowers Triton kernels for CUDA on a CPU only under an abstract
    GPU, where Mosaic GPU kernels do not lower.)"""
    q = jax.ShapeDtypeStruct((1, 200, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 333, 2, 64), jnp.bfloat16)
    config = dataclasses.replace(KernelConfig.default(64), hopper_bwd=HopperBwdConfig(portable=portable))

    def loss(q, k, v):
        out, _ = hopper_vjp.flash_attention_hopper(q, k, v, scale=0.125, band=masks.Band.of(True, None), config=config)
        return out.astype(jnp.float32).sum()

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k))
    kernels = sorted(set(re.findall(r"name=(flash\w+)", text)))
    if portable:
        assert kernels == ["flash_backward_dkdv", "flash_backward_dq", "flash_forward_sm90"]
        assert text.count("pallas_call[") == 2
    else:
        assert kernels == ["flash_backward_dkdv_sm90", "flash_backward_dq_sm90", "flash_forward_sm90"]
        assert "pallas_call[" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", GPU_GRID)
@pytest.mark.parametrize("variant", list(HOPPER_BACKWARD_VARIANTS))
def test_gradients_match_reference(shape, dtype, is_causal, variant):
    needs_hopper()
    q, k, v, d_out, d_lse = make_backward_inputs(shape, dtype, seed=1)
    scale = shape[-1] ** -0.5
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=is_causal)
    config = dataclasses.replace(
        HopperBwdConfig.default(padded_head_dim(shape[-1])), **HOPPER_BACKWARD_VARIANTS[variant]
    )
    grads = hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, scale=scale, is_causal=is_causal, config=config)
    _, vjp = jax.vjp(
        lambda *x: reference.attention_reference(*x, scale=scale, is_causal=is_causal),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    want = vjp((d_out.astype(jnp.float32), d_lse))
    for name, ours, ref, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        assert_close(ours, ref, dtype, table=GRADIENT, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("portable", [False, True], ids=["hopper_bwd", "portable_bwd"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_grad_of_mosaic_attention(is_causal, portable):
    """`jax.grad` of `flash_attention(implementation="mosaic")` against the reference: the Hopper backward (the
    default), and the portable one after the Hopper forward (`HopperBwdConfig(portable=True)`)."""
    needs_hopper()
    q, k, v, d_out, _ = make_backward_inputs((2, 640, 640, 4, 2, 128), jnp.bfloat16, seed=2)
    config = (
        dataclasses.replace(KernelConfig.default(128), hopper_bwd=HopperBwdConfig(portable=True)) if portable else None
    )

    def loss(attend, *x):
        return jnp.vdot(attend(*x).astype(jnp.float32), d_out.astype(jnp.float32))

    ours = jax.grad(
        functools.partial(
            loss, lambda *x: pf.flash_attention(*x, is_causal=is_causal, implementation="mosaic", config=config)
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    ref = jax.grad(
        functools.partial(loss, lambda *x: reference.attention_reference(*x, scale=128**-0.5, is_causal=is_causal)[0]),
        argnums=(0, 1, 2),
    )(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip(("dq", "dk", "dv"), ours, ref):
        assert_close(a, b, jnp.bfloat16, table=GRADIENT, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_pass_grad_under_vmap(is_causal, deterministic):
    """The one-pass backward at head_dim 64 (the default: dQ adds ordered, or free with deterministic=False)
    under jax.vmap (folded into the batch by `_fold_vmap`), against the reference per example."""
    needs_hopper()
    q, k, v, d_out, _ = make_backward_inputs((3, 777, 1000, 4, 2, 64), jnp.bfloat16, seed=3)

    def loss(attend, q, k, v, d_out):
        return jnp.vdot(attend(q[None], k[None], v[None])[0].astype(jnp.float32), d_out.astype(jnp.float32))

    ours = jax.vmap(
        jax.grad(
            functools.partial(
                loss,
                lambda *x: pf.flash_attention(
                    *x, is_causal=is_causal, implementation="mosaic", deterministic=deterministic
                ),
            ),
            argnums=(0, 1, 2),
        )
    )(q, k, v, d_out)
    ref = jax.vmap(
        jax.grad(
            functools.partial(
                loss, lambda *x: reference.attention_reference(*x, scale=64**-0.5, is_causal=is_causal)[0]
            ),
            argnums=(0, 1, 2),
        )
    )(*(x.astype(jnp.float32) for x in (q, k, v)), d_out)
    for name, a, b in zip(("dq", "dk", "dv"), ours, ref):
        assert_close(a, b, jnp.bfloat16, table=GRADIENT, what=name)
