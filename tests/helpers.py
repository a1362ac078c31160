"""What more than one test module builds: inputs, the float32 oracle, the grid check every implementation runs,
segment ids, the reference's view of a call's masks, score-modifier cases and the lowering tests' abstract
inputs. Tolerances live in tests/tolerances.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash import masks
from tests.tolerances import GRADIENT, assert_close

# Small tiles, so that in interpret mode every loop, diagonal tile and ragged tail runs at small shapes.
SMALL_BLOCKS = pf.KernelConfig(
    block_q=16, block_kv=16, block_q_dkv=16, block_kv_dkv=32, block_q_dq=32, block_kv_dq=16, xla_block_kv=16
)


def shape_id(shape) -> str:
    """A test id for a (batch, q_len, kv_len, heads, kv_heads, head_dim) shape."""
    return "x".join(map(str, shape))


# ---- inputs ---------------------------------------------------------------------------------------------------


def _normal(rng, shape, dtype):
    # Drawn by NumPy: jax.random would compile a program per new shape, a few hundred ms each on CPU.
    return jnp.asarray(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype)))


def make_inputs(shape, dtype, seed):
    """(q, k, v, cotangent) of unit-normal values for a (batch, q_len, kv_len, heads, kv_heads, head_dim) shape,
    drawn in float32 and cast to `dtype`."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    rng = np.random.default_rng(seed)
    q = _normal(rng, (batch, q_len, heads, head_dim), dtype)
    k = _normal(rng, (batch, kv_len, kv_heads, head_dim), dtype)
    v = _normal(rng, (batch, kv_len, kv_heads, head_dim), dtype)
    cotangent = _normal(rng, (batch, q_len, heads, head_dim), dtype)
    return q, k, v, cotangent


def make_backward_inputs(shape, dtype, seed):
    """(q, k, v, d_out, d_lse) for a backward kernel called directly: `make_inputs` plus a small float32
    cotangent of the LSE [batch, heads, q_len]."""
    q, k, v, d_out = make_inputs(shape, dtype, seed)
    batch, q_len, _, heads, _, _ = shape
    d_lse = 0.1 * _normal(np.random.default_rng(seed + 1000), (batch, heads, q_len), jnp.float32)
    return q, k, v, d_out, d_lse


def abstract_inputs(shape, segments: bool):
    """(q, k, lse, (q_ids, kv_ids)) as bf16 / float32 / int32 shapes for the lowering tests; `shape`: (batch,
    q_len, kv_len, heads, kv_heads, head_dim); ids None without segments."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    ids = (
        (jax.ShapeDtypeStruct((batch, q_len), jnp.int32), jax.ShapeDtypeStruct((batch, kv_len), jnp.int32))
        if segments
        else (None, None)
    )
    return q, k, lse, ids


MOSAIC_CALL = "stablehlo.custom_call @mosaic_gpu"  # one Mosaic GPU kernel in `lower_for_cuda`'s text


def all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (scan, cond, jit and custom_vjp bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from all_eqns(sub)


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of `fn` jitted and lowered for CUDA on this machine (nothing runs)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ---- segment ids ----------------------------------------------------------------------------------------------


def packed_ids(length: int, *starts: int):
    """int32 [length] ids of documents packed back to back: id i from starts[i - 1] (sorted) on."""
    return np.searchsorted(np.asarray(starts, np.int64), np.arange(length), side="right").astype(np.int32)


def packed_segment_ids(batch: int, length: int, starts):
    """int32 [batch, length]: example b's ids step up by one at each of starts[b] (packed sequences)."""
    return jnp.asarray(np.stack([packed_ids(length, *s) for s in starts[:batch]]))


def random_segment_ids(key, batch, length, num_segments):
    """Sorted random segment ids (packed sequences) [batch, length]."""
    return jnp.sort(jax.random.randint(key, (batch, length), 0, num_segments), axis=1).astype(jnp.int32)


def random_blocks(seed, shape, density=0.5):
    """A random bool array (a BlockMask's blocks), True with probability `density`."""
    return np.random.default_rng(seed).random(shape) < density


def reference_mask_args(shape, kwargs, is_causal):
    """The reference's band and segment ids for a flash_attention call's mask arguments, built through the
    public API's own folding (lengths become padding ids)."""
    from pallas_flash import api

    q, k, _, _ = make_inputs(shape, jnp.float32, 0)
    window = api._check_window(kwargs.get("local_window_size"))
    q_ids, kv_ids = api._segments(
        q,
        k,
        kwargs.get("segment_ids"),
        kwargs.get("kv_segment_ids"),
        kwargs.get("query_seq_lengths"),
        kwargs.get("key_value_seq_lengths"),
    )
    return dict(band=masks.Band.of(is_causal, window), q_segment_ids=q_ids, kv_segment_ids=kv_ids)


# ---- the oracle and the grid check ----------------------------------------------------------------------------


def reference(q, k, v, *, is_causal, scale=None):
    """(out, lse) of the dense reference in float32."""
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return pf.attention_reference(*f32, scale=scale, is_causal=is_causal)


def _outputs_and_grads(ours, ref, primals, ref_primals, cotangent):
    """((out, lse), grads) of `ours` at `primals` and of `ref` at `ref_primals`, the gradients those of
    sum(out * cotangent), all in one jitted function: one compile per check instead of one per call and
    transformation (XLA's compile is most of a CPU test's time)."""

    @jax.jit
    def run(primals, ref_primals):
        (out, lse), vjp = jax.vjp(ours, *primals)
        (ref_out, ref_lse), ref_vjp = jax.vjp(ref, *ref_primals)
        grads = vjp((cotangent.astype(out.dtype), jnp.zeros_like(lse)))
        ref_grads = ref_vjp((cotangent.astype(ref_out.dtype), jnp.zeros_like(ref_lse)))
        return (out, lse), grads, (ref_out, ref_lse), ref_grads

    return run(tuple(primals), tuple(ref_primals))


def check_against_reference(impl, shape, dtype, is_causal, config, seed=0):
    """Output, LSE and dq/dk/dv of `flash_attention(implementation=impl)` against the float32 reference."""
    q, k, v, cotangent = make_inputs(shape, dtype, seed)
    attend = functools.partial(
        pf.flash_attention, is_causal=is_causal, implementation=impl, config=config, return_lse=True
    )
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, lse), grads, (ref_out, ref_lse), ref_grads = _outputs_and_grads(
        attend, functools.partial(reference, is_causal=is_causal), (q, k, v), f32, cotangent
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (shape[0], shape[3], shape[1])
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, jnp.float32, what="lse")
    for name, g, rg, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, rg, dtype, table=GRADIENT, what=f"d{name}")


def _check_rows_and_lse(out, lse, ref_out, ref_lse, dtype):
    """Output and LSE against the reference where rows may see no key: those rows must be exact zeros with
    LSE -inf in both. Returns the [batch, q_len, heads] rows that see no key."""
    assert_close(out, ref_out, dtype)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # the same rows see nothing
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    empty = np.asarray(np.isneginf(ref_lse)).transpose(0, 2, 1)  # [batch, q_len, heads]
    assert np.all(np.asarray(out)[empty] == 0.0), "rows that see no key must be zeros"
    return empty


def check_masked_against_reference(
    impl, shape, kwargs, is_causal, *, dtype=jnp.float32, config=SMALL_BLOCKS, seed=8, block_mask=None
):
    """`flash_attention(implementation=impl, **kwargs)` with mask arguments (segment ids, lengths, a window, a
    block mask) against the reference given the same masks: output, LSE, dq/dk/dv; rows that see no key must
    be exact zeros with LSE -inf. Returns the [batch, q_len, heads] rows that see no key."""
    q, k, v, cotangent = make_inputs(shape, dtype, seed)
    extra = {} if block_mask is None else dict(block_mask=block_mask)
    ours = functools.partial(
        pf.flash_attention, is_causal=is_causal, implementation=impl, config=config, return_lse=True, **extra, **kwargs
    )
    ref = functools.partial(
        pf.attention_reference, scale=shape[-1] ** -0.5, **extra, **reference_mask_args(shape, kwargs, is_causal)
    )
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, lse), grads, (ref_out, ref_lse), ref_grads = _outputs_and_grads(ours, ref, (q, k, v), f32, cotangent)
    assert out.dtype == q.dtype and out.shape == q.shape
    empty = _check_rows_and_lse(out, lse, ref_out, ref_lse, dtype)
    for name, g, rg, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, rg, dtype, table=GRADIENT, what=f"d{name}")
    return empty


# ---- score modifiers ------------------------------------------------------------------------------------------


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def random_mask(seed, shape, hide=0.3):
    return jax.random.uniform(jax.random.key(seed), shape) > hide


# GQA, lengths that are not block multiples (3 query and key blocks of 16)
MODIFIER_SHAPE = (2, 37, 45, 4, 2, 16)


def modifier_case(name, shape):
    """Keyword arguments of flash_attention for a named score-modifier case, with arrays for `shape`."""
    batch, q_len, kv_len, heads, _, _ = shape
    rows_hidden = random_mask(21, (batch, 1, q_len, kv_len)).at[:, :, 3, :].set(False)  # query 3 sees nothing
    minus_inf_row = normal(22, (batch, heads, q_len, kv_len)).at[1, :, 5, :].set(-jnp.inf)
    return {
        "bias_full": dict(bias=normal(23, (batch, heads, q_len, kv_len))),
        "bias_heads_keys": dict(bias=normal(24, (1, heads, 1, kv_len), 2.0)),
        "bias_batch_queries": dict(bias=normal(25, (batch, 1, q_len, 1), 2.0)),
        "bias_rank2_bf16": dict(bias=normal(26, (q_len, kv_len)).astype(jnp.bfloat16)),
        "bias_minus_inf_rows": dict(bias=minus_inf_row),
        "mask_empty_rows": dict(mask=rows_hidden),
        "mask_keys": dict(mask=random_mask(27, (batch, 1, 1, kv_len), 0.5)),
        "alibi": dict(alibi_slopes=jnp.geomspace(0.5, 0.05, heads)),
        "alibi_per_example_soft_cap": dict(alibi_slopes=normal(28, (batch, heads), 0.1) ** 2, logits_soft_cap=1.5),
        "soft_cap": dict(logits_soft_cap=0.7),
        "dropout": dict(dropout_rate=0.3, dropout_rng=jax.random.key(29)),
        "dropout_broadcast": dict(dropout_rate=0.5, dropout_rng=jax.random.key(30), broadcast_dropout=True),
        "everything": dict(
            bias=normal(31, (1, heads, q_len, kv_len)),
            mask=rows_hidden,
            alibi_slopes=jnp.geomspace(0.5, 0.05, heads),
            logits_soft_cap=2.0,
            dropout_rate=0.2,
            dropout_rng=jax.random.key(32),
        ),
    }[name]


MODIFIER_CASES = [
    "bias_full",
    "bias_heads_keys",
    "bias_batch_queries",
    "bias_rank2_bf16",
    "bias_minus_inf_rows",
    "mask_empty_rows",
    "mask_keys",
    "alibi",
    "alibi_per_example_soft_cap",
    "soft_cap",
    "dropout",
    "dropout_broadcast",
    "everything",
]
# Cases meant to contain rows that see no key.
MODIFIER_CASES_WITH_EMPTY_ROWS = ("mask_empty_rows", "bias_minus_inf_rows", "everything")


def modifier_block_mask(shape):
    """A random per-head BlockMask of 16 x 16 blocks for `shape`, with a query block of head 0 that sees
    nothing and a key block of head 1 that nobody sees."""
    _, q_len, kv_len, heads, _, _ = shape
    nq, nk = -(-q_len // 16), -(-kv_len // 16)
    blocks = np.random.default_rng(70).random((1, heads, nq, nk)) < 0.6
    blocks[0, 0, 1, :] = False
    blocks[0, 1, :, 2] = False
    return pf.BlockMask(blocks, 16, 16)


def modifier_with_block_mask_case(name, shape):
    """Modifier arguments combined with `modifier_block_mask` in one call."""
    batch, q_len, kv_len, heads, _, _ = shape
    return dict(
        {
            # dbias sums dS over query blocks: the hidden tiles must add nothing
            "bias_heads_keys": dict(bias=normal(71, (1, heads, 1, kv_len), 2.0)),
            "mask": dict(mask=random_mask(72, (batch, 1, q_len, kv_len))),
            "dropout_bias": dict(
                dropout_rate=0.3, dropout_rng=jax.random.key(73), bias=normal(74, (batch, 1, q_len, 1))
            ),
        }[name],
        block_mask=modifier_block_mask(shape),
    )


def _reference_modifier_kwargs(kwargs):
    """flash_attention's modifier arguments in the reference's terms (the seed instead of the key)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    rng = kwargs.pop("dropout_rng", None)
    if rng is not None:
        kwargs["dropout_seed"] = masks.dropout_seed(rng)
    return kwargs


def check_modifiers_against_reference(impl, shape, dtype, is_causal, kwargs, config, seed=0):
    """Outputs, LSE, dq/dk/dv and (with a bias) dbias of `impl` against the reference with the same
    modifiers; rows that see no key must give zeros and LSE -inf, and every gradient must be finite.
    Returns the [batch, q_len, heads] rows that see no key."""
    q, k, v, cotangent = make_inputs(shape, dtype, seed)
    bias = kwargs.get("bias")
    rest = {name: value for name, value in kwargs.items() if name != "bias"}
    scale = shape[-1] ** -0.5
    primals = (q, k, v) if bias is None else (q, k, v, bias)

    def ours(q, k, v, bias=None):
        return pf.flash_attention(
            q, k, v, bias=bias, is_causal=is_causal, implementation=impl, config=config, return_lse=True, **rest
        )

    def ref(q, k, v, bias=None):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return pf.attention_reference(
            *f32, scale=scale, is_causal=is_causal, bias=bias, **_reference_modifier_kwargs(rest)
        )

    (out, lse), grads, (ref_out, ref_lse), ref_grads = _outputs_and_grads(ours, ref, primals, primals, cotangent)
    assert out.dtype == q.dtype and out.shape == q.shape
    empty = _check_rows_and_lse(out, lse, ref_out, ref_lse, dtype)
    for name, g, rg, x in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads, primals):
        assert g.shape == rg.shape == x.shape and g.dtype == x.dtype, name
        assert_close(g, rg, dtype, table=GRADIENT, what=name)
    return empty


# ---- the Hopper backward's variants ---------------------------------------------------------------------------

HOPPER_BACKWARD_VARIANTS = {  # HopperBwdConfig fields over the default's, per backward variant under test
    "two_pass": dict(
        dq_atomic=False, dq_ordered=False, dq_overlap=False, num_stages_dq=2, dkv_overlap=False, num_stages_dkv=2
    ),
    "two_pass_dq_overlap": dict(
        dq_atomic=False, dq_ordered=False, dq_overlap=True, num_stages_dq=4, dkv_overlap=False, num_stages_dkv=2
    ),
    "two_pass_dkv_overlap": dict(
        dq_atomic=False, dq_ordered=False, dkv_overlap=True, num_stages_dkv=4, delta_in_dp=False
    ),
    "two_pass_dkv_overlap_delta_in_dp": dict(
        dq_atomic=False, dq_ordered=False, dkv_overlap=True, num_stages_dkv=4, delta_in_dp=True
    ),
    "one_pass": dict(dq_atomic=True, dq_ordered=False, num_stages_dkv=2),
}


# ---- the Hopper backward in the Mosaic GPU interpreter ----------------------------------------------------------


def interpreted_hopper_backward(q, k, v, out, lse, d_out, d_lse, **kwargs):
    """`hopper.bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, **kwargs)` (kwargs carry `interpret`), after
    checking that the interpreter's race detection found no race in either kernel (dK/dV, then dQ)."""
    from pallas_flash import _compat
    from pallas_flash.hopper import bwd as hopper_bwd

    with _compat.mosaic_gpu_race_states() as kernels:
        results = jax.block_until_ready(hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, **kwargs))
    assert [state.races_found for state in kernels] == [False, False]
    return results


def assert_gradients_close(grads, want, inputs=None, names=("dq", "dk", "dv"), dtype=jnp.bfloat16):
    """Each gradient within `dtype`'s gradient tolerance of the reference's, and (given the `inputs` they belong
    to) of its input's shape and dtype."""
    for i, (name, grad, ref) in enumerate(zip(names, grads, want)):
        if inputs is not None:
            assert grad.shape == inputs[i].shape and grad.dtype == inputs[i].dtype, name
        assert_close(grad, ref, dtype, table=GRADIENT, what=name)
