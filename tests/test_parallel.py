"""Context parallelism (pallas_flash.parallel) on 2, 4 and 8 CPU devices (tests/conftest.py forces 8): outputs, LSE
and gradients equal one device's call on the whole sequence, and repeat bitwise; causal with both layouts, GQA,
packed documents across shard borders, windows, both strategies; the ring's backward runs no forward. The same
checks on two H100s are `gpu`."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash import parallel
from tests.helpers import all_eqns, normal
from tests.tolerances import GRADIENT, assert_close

CONFIG = pf.KernelConfig(xla_block_kv=16)


def _mesh(devices):
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices")
    return Mesh(np.array(jax.devices()[:devices]), ("context",))


def _check(devices, *, layout="contiguous", strategy="ring", is_causal=True, window=None, kv_heads=4, docs=False,
           seq=64, dtype=jnp.float32, implementation="xla_chunked"):  # fmt: skip
    mesh = _mesh(devices)
    shape = (2, seq, 4, 16)
    q = normal(0, shape).astype(dtype)
    k, v = (normal(i, (2, seq, kv_heads, 16)).astype(dtype) for i in (1, 2))
    w = normal(3, shape)
    ids = None
    if docs:  # documents crossing every shard border
        ids = jnp.asarray(np.cumsum(np.random.default_rng(0).random((2, seq)) < 0.08, axis=1), jnp.int32)
    kwargs = dict(is_causal=is_causal, local_window_size=window, implementation=implementation, config=CONFIG)

    def whole(q, k, v):
        return pf.flash_attention(q, k, v, segment_ids=ids, return_lse=True, **kwargs)

    perm = parallel.zigzag_order(seq, devices) if layout == "zigzag" else np.arange(seq)
    inv = np.argsort(perm)

    @jax.jit
    def sharded(q, k, v):
        ids_p = None if ids is None else ids[:, perm]
        out, lse = parallel.context_parallel_attention(
            q[:, perm], k[:, perm], v[:, perm], mesh=mesh, segment_ids=ids_p, layout=layout, strategy=strategy,
            return_lse=True, **kwargs,
        )  # fmt: skip
        return out[:, inv], lse[:, :, inv]

    want_out, want_lse = whole(q, k, v)
    out, lse = sharded(q, k, v)
    assert_close(out, want_out, dtype)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)

    def loss(f):
        def value(q, k, v):
            out, lse = f(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return value

    grads = jax.jit(jax.grad(loss(sharded), (0, 1, 2)))(q, k, v)
    want = jax.grad(loss(whole), (0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, want):
        assert_close(g, r, dtype, table=GRADIENT, what=f"d{name}")
    again = jax.jit(jax.grad(loss(sharded), (0, 1, 2)))(q, k, v)
    for g, h in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize(
    "devices, layout",
    [(2, "contiguous"), (8, "zigzag")] + [pytest.param(*c, marks=pytest.mark.slow) for c in
                                          [(4, "contiguous"), (8, "contiguous"), (2, "zigzag"), (4, "zigzag")]],
)  # fmt: skip
def test_causal_ring_equals_one_device(devices, layout):
    _check(devices, layout=layout)


@pytest.mark.parametrize(  # `slow` for CI time: zig-zag documents also run in the two-device and all-gather tests
    "kwargs",
    [
        dict(is_causal=False),
        dict(kv_heads=2, docs=True),
        pytest.param(dict(layout="zigzag", kv_heads=1, docs=True), marks=pytest.mark.slow),
        pytest.param(dict(is_causal=False, window=(5, 3)), marks=pytest.mark.slow),
        dict(window=(9, 0), layout="zigzag"),
    ],
    ids=["full", "gqa_docs", "zigzag_mqa_docs", "window", "zigzag_causal_window"],
)
def test_ring_features(kwargs):
    _check(4, **kwargs)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_two_devices_send_key_pieces(layout):
    """On two devices the K/V travel already cut into the receiver's key pieces and their dK/dV return uncut
    (`parallel._sends_pieces`): packed documents across the border, GQA."""
    _check(2, layout=layout, kv_heads=2, docs=True)


@pytest.mark.slow
def test_ring_on_the_portable_kernels():
    """The ring's steps and their residual backwards on the Pallas kernels (interpret mode): the zig-zag cases."""
    _check(2, layout="zigzag", implementation="pallas", docs=True, seq=32)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_backward_runs_no_forward(layout, monkeypatch):
    """The ring's gradient traces one forward call per step (the forward pass) and one backward call per step
    (`attention_backward` on the merged residuals): no step's forward is recomputed, and no step branches on the
    device index."""
    devices = 4
    mesh = _mesh(devices)
    counts = collections.Counter()
    for name in ("flash_attention", "attention_backward"):

        def counted(*args, _fn=getattr(parallel, name), _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(parallel, name, counted)
    x = normal(0, (1, 32, 2, 16))

    def loss(q, k, v):
        out = parallel.context_parallel_attention(
            q, k, v, mesh=mesh, is_causal=True, layout=layout, strategy="ring", implementation="xla_chunked",
            config=CONFIG,
        )  # fmt: skip
        return jnp.sum(out)

    jax.make_jaxpr(loss)(x, x, x)
    steps = devices  # one call per step: the own shard, then the pieces stacked on the batch axis
    assert counts == {"flash_attention": steps}
    counts.clear()
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, x, x)
    assert counts == {"flash_attention": steps, "attention_backward": steps}
    # XLA's GPU runtime runs a cond by reading its index back to the host: a ring step must not branch.
    assert not {eqn.primitive.name for eqn in all_eqns(jaxpr.jaxpr)} & {"cond", "switch"}


def test_two_device_accumulators(monkeypatch):
    """On two devices the dK/dV of the other device's K/V travel in bf16 (half the bytes sent): the gradients stay
    within bf16 rounding of float32 travel, and dQ (summed in float32, rounded once) is bitwise the same
    (zig-zag causal: both pieces of the foreign step add into half the rows)."""
    mesh = _mesh(2)
    q, k, v = (normal(i, (2, 64, 4, 16)).astype(jnp.bfloat16) for i in range(3))
    w = normal(3, q.shape)

    def grads():
        def loss(q, k, v):
            out = parallel.context_parallel_attention(
                q, k, v, mesh=mesh, is_causal=True, layout="zigzag", strategy="ring", implementation="xla_chunked",
                config=CONFIG,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32) * w)

        return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

    ours = grads()
    monkeypatch.setattr(parallel, "_accumulator_dtype", lambda num_shards, dtype: jnp.float32)
    wide = grads()
    for name, g, h in zip("qkv", ours, wide):
        assert g.dtype == h.dtype == jnp.bfloat16
        if name == "q":
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(h.astype(jnp.float32)))
        else:
            assert_close(g, h, jnp.bfloat16, table=GRADIENT, what=f"d{name}")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_all_gather_strategy(layout):
    _check(4, layout=layout, strategy="all_gather", docs=True, kv_heads=2)


def test_zigzag_order_round_trips_and_balances():
    order = parallel.zigzag_order(16, 4)
    assert sorted(order) == list(range(16))
    np.testing.assert_array_equal(order[:4], [0, 1, 14, 15])  # shard 0: chunks 0 and 7
    x = jnp.arange(32).reshape(2, 16)
    np.testing.assert_array_equal(parallel.from_zigzag(parallel.to_zigzag(x, 4), 4), x)
    for shard in range(4):
        np.testing.assert_array_equal(parallel.shard_positions(4, shard, 4, "zigzag"), order[4 * shard : 4 * shard + 4])


def test_bad_arguments():
    mesh = _mesh(2)
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="layout must be one of"):
        parallel.context_parallel_attention(q, q, q, mesh=mesh, layout="spiral")
    with pytest.raises(ValueError, match="strategy must be None or one of"):
        parallel.context_parallel_attention(q, q, q, mesh=mesh, strategy="tree")
