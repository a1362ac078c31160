"""A value head_dim of its own (DeepSeek's MLA: query/key 192, value 128): value [batch, kv_len, kv_heads,
head_dim_v] gives out [batch, q_len, heads, head_dim_v]. The XLA paths ("xla_chunked", "xla", and flash_decode's
"xla" and "reference") and the portable kernels ("pallas", each head_dim padded to its own power of two) serve it; so
does "mosaic" where both its kernels have tiles for the two head dims (tests/hopper/test_head_dims.py), and it
refuses the others by name, where implementation=None runs "pallas" on a GPU (logged). Checked against a float32
oracle written out here, independent of the package."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import api, device
from tests.helpers import SMALL_BLOCKS
from tests.tolerances import GRADIENT, assert_close

HEAD_DIMS = [(192, 128), (128, 64), (64, 96)]  # (query and key, value)
HP = jax.lax.Precision.HIGHEST


def _inputs(seed, batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v, dtype=jnp.float32):
    """(q, k, v, d_out, d_lse): unit normals drawn by NumPy (no compile per shape), a small lse cotangent."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    q = draw(batch, q_len, heads, head_dim)
    k = draw(batch, kv_len, kv_heads, head_dim)
    v = draw(batch, kv_len, kv_heads, head_dim_v)
    d_out = draw(batch, q_len, heads, head_dim_v)
    d_lse = 0.1 * jnp.asarray(rng.standard_normal((batch, heads, q_len), np.float32))
    return q, k, v, d_out, d_lse


def _oracle(q, k, v, visible, *, scale, extra=None, sinks=None):
    """Dense float32 attention written out: logits [batch, heads, q_len, kv_len] (+ `extra`), hidden where
    `visible` (broadcastable to them) is False, softmax with each head's sink in the denominator, then the
    values. Returns (out [batch, q_len, heads, head_dim_v], lse [batch, heads, q_len]); a row that sees no
    key gets zeros and lse = -inf."""
    heads, kv_heads = q.shape[2], k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), heads // kv_heads, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), heads // kv_heads, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision=HP) * scale
    if extra is not None:
        s = s + extra
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isneginf(m), 0.0, m))
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks[None, :, None, None] - m)
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / safe, v, precision=HP)
    lse = jnp.where(empty, -jnp.inf, jnp.log(safe) + m)[..., 0]
    return out, lse


def _loss(out, lse, d_out, d_lse):
    """A scalar through both results (lse's -inf rows contribute nothing)."""
    finite_lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)) + jnp.sum(finite_lse * d_lse)


def _check(ours_fn, oracle_fn, primals, d_out, d_lse, dtype):
    """Outputs, LSEs (finite where the oracle's are, -inf elsewhere) and the gradients of `_loss` in every
    primal, ours against the oracle's."""
    out, lse = ours_fn(*primals)
    ref_out, ref_lse = oracle_fn(*primals)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert_close(out, ref_out, dtype)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert_close(jnp.where(jnp.isneginf(lse), 0.0, lse), jnp.where(jnp.isneginf(ref_lse), 0.0, ref_lse), dtype)
    grads = jax.grad(lambda *p: _loss(*ours_fn(*p), d_out, d_lse), argnums=tuple(range(len(primals))))(*primals)
    f32 = [x.astype(jnp.float32) for x in primals]
    ref_grads = jax.grad(lambda *p: _loss(*oracle_fn(*p), d_out, d_lse), argnums=tuple(range(len(f32))))(*f32)
    for i, (g, ref) in enumerate(zip(grads, ref_grads)):
        assert g.shape == primals[i].shape
        assert_close(g, ref, dtype, table=GRADIENT, what=f"gradient of primal {i}")


def _oracle_grid():
    """(head_dims, is_causal, impl): every pair causal on every implementation; non-causal, the first pair only
    outside `slow` (CI's time: causality is the same mask at every head dim)."""
    return [
        pytest.param(
            dims,
            causal,
            impl,
            id=f"{dims[0]}-{dims[1]}-{causal}-{impl}",
            marks=pytest.mark.slow if not causal and dims != HEAD_DIMS[0] else (),
        )
        for dims in HEAD_DIMS
        for causal in (False, True)
        for impl in ("xla_chunked", "xla", "pallas")
    ]


@pytest.mark.parametrize("head_dims, is_causal, impl", _oracle_grid())
def test_value_head_dim_against_the_oracle(head_dims, is_causal, impl):
    """GQA (4 query heads on 2 kv heads), q_len != kv_len, ragged lengths (sequence 1's last queries see nothing)
    and key blocks with a ragged tail (xla_block_kv 16 over 20 keys): out, lse, dq, dk, dv."""
    batch, q_len, kv_len, heads, kv_heads = 2, 12, 20, 4, 2
    q, k, v, d_out, d_lse = _inputs(0, batch, q_len, kv_len, heads, kv_heads, *head_dims)
    q_lens, kv_lens = jnp.array([12, 9]), jnp.array([20, 7])
    scale = 1.0 / np.sqrt(head_dims[0])
    i, j = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    visible = (i < q_lens[:, None, None]) & (j < kv_lens[:, None, None])
    if is_causal:
        visible = visible & (j <= i)

    def ours(q, k, v):
        return pf.flash_attention(
            q,
            k,
            v,
            is_causal=is_causal,
            query_seq_lengths=q_lens,
            key_value_seq_lengths=kv_lens,
            return_lse=True,
            implementation=impl,
            config=SMALL_BLOCKS,
        )

    _check(ours, lambda q, k, v: _oracle(q, k, v, visible[:, None], scale=scale), (q, k, v), d_out, d_lse, q.dtype)


@pytest.mark.parametrize("impl", ["xla_chunked", "xla", "pallas"])
def test_value_head_dim_with_sinks_score_mod_and_mask_mod(impl):
    """MLA's head dims under a score_mod closing over per-head slopes (their gradient too), a mask_mod and sinks:
    each modifier is applied to the logits, so value's head_dim changes nothing about them."""
    batch, q_len, kv_len, heads, kv_heads = 1, 8, 24, 4, 1
    q, k, v, d_out, d_lse = _inputs(1, batch, q_len, kv_len, heads, kv_heads, 192, 128)
    rng = np.random.default_rng(2)
    slopes = jnp.asarray(rng.uniform(0.1, 0.5, heads).astype(np.float32))
    sinks = jnp.asarray(rng.standard_normal(heads).astype(np.float32))
    scale = 1.0 / np.sqrt(192)
    i, j = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
    visible = (i + j) % 3 != 0

    def ours(q, k, v, slopes):
        return pf.flash_attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki).astype(jnp.float32),
            mask_mod=lambda b, h, qi, ki: (qi + ki) % 3 != 0,
            sinks=sinks,
            return_lse=True,
            implementation=impl,
            config=SMALL_BLOCKS,
        )

    def oracle(q, k, v, slopes):
        extra = -slopes[None, :, None, None] * jnp.abs(i - j).astype(jnp.float32)
        return _oracle(q, k, v, visible, scale=scale, extra=extra, sinks=sinks)

    _check(ours, oracle, (q, k, v, slopes), d_out, d_lse, q.dtype)


def test_value_head_dim_in_bfloat16():
    """bfloat16 inputs at MLA's head dims, causal, against the float32 oracle within bfloat16's tolerance."""
    q, k, v, d_out, d_lse = _inputs(3, 1, 16, 16, 2, 2, 192, 128, jnp.bfloat16)
    visible = jnp.arange(16)[None, :] <= jnp.arange(16)[:, None]

    def ours(q, k, v):
        return pf.flash_attention(q, k, v, is_causal=True, return_lse=True, config=SMALL_BLOCKS)

    oracle = lambda q, k, v: _oracle(q, k, v, visible, scale=1.0 / np.sqrt(192))  # noqa: E731
    _check(ours, oracle, (q, k, v), d_out, d_lse, jnp.bfloat16)


def test_attention_backward_takes_value_head_dim():
    """attention_backward on the residuals of an MLA-shaped forward gives the forward's own gradients."""
    q, k, v, d_out, d_lse = _inputs(4, 1, 10, 14, 4, 2, 128, 64)
    options = dict(is_causal=True, implementation="xla_chunked", config=SMALL_BLOCKS)
    (out, lse), vjp = jax.vjp(lambda q, k, v: pf.flash_attention(q, k, v, return_lse=True, **options), q, k, v)
    ours = api.attention_backward(q, k, v, out, lse, d_out, d_lse, **options)
    for g, ref in zip(ours, vjp((d_out, d_lse))):
        assert g.shape == ref.shape
        assert_close(g, ref, jnp.float32, table=GRADIENT)


def test_mosaic_refuses_value_head_dim_by_name(monkeypatch):
    """Forced on sm90 (faked), the Hopper kernels name both head_dims where no forward tiles fit them (query/key
    192 with value 256)."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    q, k, v, _, _ = _inputs(5, 1, 8, 8, 2, 2, 192, 256, jnp.bfloat16)
    words = r"head_dims 192 \(query, key\) and 256 \(value\)"
    with pytest.raises(ValueError, match=rf"implementation='mosaic' cannot serve this call: .*{words}"):
        pf.flash_attention(q, k, v, implementation="mosaic")


def test_dispatch_runs_the_portable_kernels_for_value_head_dim(monkeypatch, caplog):
    """With implementation=None on sm90 (faked) the Hopper kernels are passed over with their head_dim reason and
    the portable kernels run (traced only: there is no GPU to compile for)."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(device, "on_nvidia_gpu", lambda: True)
    q, k, v, _, _ = _inputs(6, 1, 8, 8, 2, 2, 192, 256, jnp.bfloat16)
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        out = jax.eval_shape(pf.flash_attention, q, k, v)
    assert out.shape == (1, 8, 2, 256)
    messages = [r.getMessage() for r in caplog.records]
    ran = [m for m in messages if "implementation=None ran 'pallas'" in m]
    assert ran and re.search(r"not 'mosaic': [^;]*head_dims 192 \(query, key\) and 256 \(value\)", ran[0]), messages


@pytest.mark.parametrize(
    "value_shape, words",
    [
        ((1, 9, 2, 32), "key and value must have the same shape but for head_dim"),
        ((1, 8, 1, 32), "key and value must have the same shape but for head_dim"),
        ((1, 8, 2, 8), "value's head_dim is 8; allowed: 16 to 256"),
        ((1, 8, 2, 512), "value's head_dim is 512"),
    ],
)
def test_bad_value_shape_is_named(value_shape, words):
    q = jnp.ones((1, 8, 4, 16))
    k = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match=words):
        pf.flash_attention(q, k, jnp.ones(value_shape))


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("paged", [False, True])
def test_flash_decode_value_head_dim(paged, impl):
    """flash_decode over a value cache with its own head_dim: 3 new queries per sequence, ragged lengths, GQA,
    several splits (num_splits=3), contiguous or paged (pages of 4), against the oracle."""
    batch, q_len, max_len, heads, kv_heads, dim, dim_v = 2, 3, 16, 4, 2, 192, 128
    q, k, v, _, _ = _inputs(7, batch, q_len, max_len, heads, kv_heads, dim, dim_v)
    lengths = jnp.array([16, 5])
    q_pos = lengths[:, None] - q_len + jnp.arange(q_len)[None, :]
    visible = (jnp.arange(max_len)[None, None, :] <= q_pos[:, :, None])[:, None]
    ref_out, ref_lse = _oracle(q, k, v, visible, scale=1.0 / np.sqrt(dim))
    options = dict(lengths=lengths, num_splits=3, return_lse=True, implementation=impl)
    if paged:  # sequence b's page i is page 4 * (1 - b) + i: the two sequences' pages swapped
        page, pages = 4, max_len // 4
        table = jnp.array([[pages + i for i in range(pages)], list(range(pages))])
        to_pages = lambda x: jnp.concatenate([x[1], x[0]]).reshape(2 * pages, page, *x.shape[2:])  # noqa: E731
        out, lse = pf.flash_decode(q, to_pages(k), to_pages(v), block_table=table, **options)
    else:
        out, lse = pf.flash_decode(q, k, v, **options)
    assert out.shape == (batch, q_len, heads, dim_v)
    assert_close(out, ref_out, jnp.float32)
    assert_close(lse, ref_lse, jnp.float32)


def test_flash_decode_mosaic_refuses_value_head_dim(monkeypatch):
    """Forced on sm90 (faked), the decode kernel names both head_dims; a mismatch of any other axis is an error."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    q, k, v, _, _ = _inputs(8, 1, 1, 8, 2, 2, 128, 64, jnp.bfloat16)
    words = r"implementation='mosaic' cannot serve this flash_decode call: .*head_dims are 128 .* and 64"
    with pytest.raises(ValueError, match=words):
        pf.flash_decode(q, k, v, lengths=jnp.array([8]), implementation="mosaic")
    with pytest.raises(ValueError, match="same shape but for head_dim"):
        pf.flash_decode(q, k, v[:, :4], lengths=jnp.array([4]))
