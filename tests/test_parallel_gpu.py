"""Context parallelism on two GPUs with the real kernels (bf16, implementation=None): outputs, LSE and gradients equal
one GPU's call on the whole sequence, both layouts and strategies, and repeat bitwise. Skipped without 2 GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash import device, parallel
from tests.helpers import normal
from tests.tolerances import GRADIENT, assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "layout, strategy, kv_heads, window",
    [("zigzag", "ring", 8, None), ("contiguous", "ring", 2, None), ("zigzag", "all_gather", 2, None),
     ("contiguous", "ring", 8, (300, 0))],
)  # fmt: skip
def test_two_gpus_equal_one(layout, strategy, kv_heads, window):
    if not device.on_nvidia_gpu() or len(jax.devices()) < 2:
        pytest.skip("needs 2 NVIDIA GPUs")
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    seq, dtype = 2048, jnp.bfloat16
    q = normal(0, (2, seq, 8, 64)).astype(dtype)
    k, v = (normal(i, (2, seq, kv_heads, 64)).astype(dtype) for i in (1, 2))
    w = normal(3, q.shape)
    perm = parallel.zigzag_order(seq, 2) if layout == "zigzag" else np.arange(seq)
    inv = np.argsort(perm)

    def whole(q, k, v):
        return pf.flash_attention(q, k, v, is_causal=True, local_window_size=window, return_lse=True)

    @jax.jit
    def sharded(q, k, v):
        out, lse = parallel.context_parallel_attention(
            q[:, perm], k[:, perm], v[:, perm], mesh=mesh, is_causal=True, local_window_size=window, layout=layout,
            strategy=strategy, return_lse=True,
        )  # fmt: skip
        return out[:, inv], lse[:, :, inv]

    want, got = whole(q, k, v), sharded(q, k, v)
    assert_close(got[0], want[0], dtype)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-3, atol=2e-3)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v)[0].astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss(sharded), (0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(loss(whole), (0, 1, 2)))(q, k, v)
    for name, g, r in zip("qkv", grads, want_grads):
        assert_close(g, r, dtype, table=GRADIENT, what=f"d{name}")
    again = jax.jit(jax.grad(loss(sharded), (0, 1, 2)))(q, k, v)
    for g, h in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(h.astype(jnp.float32)))
