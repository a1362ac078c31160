"""What the portable kernels do with a block mask: they never load the tiles it hides, an all-True mask runs
the dense kernels, the block-sparse kernels lower to Triton for CUDA, and on a GPU the compiled kernels at
realistic sizes against the float32 reference. The block mask's semantics in every implementation are in
tests/test_block_sparse.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, masks
from pallas_flash._compat import TritonCompilerParams
from pallas_flash.portable import vjp as portable
from tests.helpers import SMALL_BLOCKS, make_inputs, random_blocks
from tests.tolerances import GRADIENT, assert_close


def test_masked_blocks_are_never_read():
    """NaN in the keys and values of key blocks no query block may see, and in the queries of a query block
    that sees nothing: the kernels never load those tiles, so outputs and gradients stay finite and equal
    the reference on clean inputs. (The XLA chunked path computes every block and masks; it is not tested
    here: 0 * NaN is NaN.)"""
    shape = (1, 64, 64, 2, 1, 16)
    block_mask = pf.BlockMask(np.array([[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 0, 1, 0]], bool), 16, 16)
    q, k, v, cotangent = make_inputs(shape, jnp.float32, seed=13)
    hidden_keys = (np.arange(64) // 16) % 2 == 1  # key blocks 1 and 3
    hidden_queries = np.arange(64) // 16 == 1  # query block 1
    nan = lambda x, rows: x.at[:, rows].set(jnp.nan)
    q_nan, k_nan, v_nan = nan(q, hidden_queries), nan(k, hidden_keys), nan(v, hidden_keys)
    ours = functools.partial(
        pf.flash_attention, implementation="pallas", config=SMALL_BLOCKS, return_lse=True, block_mask=block_mask
    )
    ref = functools.partial(pf.attention_reference, scale=16**-0.5, block_mask=block_mask)
    loss = lambda fn, q, k, v: jnp.sum(fn(q, k, v)[0] * cotangent)

    @jax.jit
    def run(q_nan, k_nan, v_nan):
        return ours(q_nan, k_nan, v_nan), jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(
            q_nan, k_nan, v_nan
        )

    (out, lse), grads = run(q_nan, k_nan, v_nan)
    ref_out, ref_lse = ref(q, k, v)
    assert_close(out, ref_out, jnp.float32)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)) and not np.isnan(lse).any()
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT, what=f"d{name}")  # also asserts finite


def test_full_block_mask_runs_the_dense_kernels():
    """An all-True mask is dropped at the boundary: the benchmark's dense baseline is the dense kernel."""
    q, k, v, _ = make_inputs((1, 40, 40, 2, 2, 16), jnp.float32, seed=17)
    full = pf.BlockMask.full(40, 40, block_q=16, block_kv=16)
    jaxpr = str(
        jax.make_jaxpr(
            functools.partial(pf.flash_attention, implementation="pallas", config=SMALL_BLOCKS, block_mask=full)
        )(q, k, v)
    )
    dense = str(
        jax.make_jaxpr(functools.partial(pf.flash_attention, implementation="pallas", config=SMALL_BLOCKS))(q, k, v)
    )
    assert jaxpr == dense


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [False, True])
def test_block_sparse_default_blocks_interpret(is_causal):
    """The default KernelConfig (128-row tiles) under a 64 x 128 mask: the kernel tiles shrink to 64 rows."""
    shape = (1, 300, 280, 2, 1, 64)
    block_mask = pf.BlockMask.global_local(300, 280, 1, 1, block_q=64, block_kv=128)
    q, k, v, cotangent = make_inputs(shape, jnp.float32, seed=15)
    ours = functools.partial(pf.flash_attention, is_causal=is_causal, implementation="pallas", block_mask=block_mask)
    ref = lambda q, k, v: pf.attention_reference(q, k, v, scale=64**-0.5, is_causal=is_causal, block_mask=block_mask)[0]
    assert_close(ours(q, k, v), ref(q, k, v), jnp.float32)
    loss = lambda fn, q, k, v: jnp.sum(fn(q, k, v) * cotangent)
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT, what=f"d{name}")


@pytest.mark.lowering
@pytest.mark.skipif(TritonCompilerParams is None, reason="this JAX has no Pallas Triton lowering")
@pytest.mark.parametrize("is_causal", [False, True])
def test_kernels_lower_to_triton_for_cuda(is_causal):
    """The block-sparse kernels (fwd, dK/dV, dQ, with segment ids) lowered for CUDA on this machine: Pallas's
    Triton lowering runs without a GPU (it assumes sm90), so primitives or loads it rejects fail here, in CI,
    not first on the GPU. Triton's own compile to PTX is not run: what fails only there still needs the GPU
    tests."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = 2, 1024, 1000, 8, 2, 128
    block_mask = pf.BlockMask(random_blocks(5, (1, heads, 16, 16), 0.3), 64, 64)
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    lengths = jnp.full((batch,), kv_len - 5, jnp.int32)

    def fwd_bwd(q, k, v):  # the kernels' own entry point: flash_attention would pick interpret mode here
        fn = lambda q, k, v: portable.flash_attention_portable(
            q,
            k,
            v,
            scale=0.1,
            band=masks.Band.of(is_causal),
            config=pf.KernelConfig.default(head_dim),
            interpret=False,
            q_segment_ids=jnp.zeros((batch, q_len), jnp.int32),
            kv_segment_ids=masks.segments_from_lengths(None, lengths, kv_len, masks.KEY_PADDING_ID),
            block_mask=block_mask,
        )
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(out)

    triton = "__gpu$xla.gpu.triton"
    with _compat.lowering_gpu():
        exported = jax.export.export(
            jax.jit(fwd_bwd), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
        )(q, k, k)
    assert exported.mlir_module().count(f"stablehlo.custom_call @{triton}") == 3


# ------------------------------------------------------------------------------------------------ GPU

GPU_PATTERNS = {  # (q_len, kv_len) -> BlockMask; the default 128 x 128 blocks unless stated
    "local": lambda n, m: pf.BlockMask.local(n, m, 2),
    "strided": lambda n, m: pf.BlockMask.strided(n, m, 4),
    "global_local": lambda n, m: pf.BlockMask.global_local(n, m, 1, 1),
    "per_head_random_64": lambda n, m: pf.BlockMask(random_blocks(4, (1, 8, -(-n // 64), -(-m // 64)), 0.3), 64, 64),
}


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pattern", list(GPU_PATTERNS))
def test_gpu_block_sparse(pattern, head_dim, is_causal):
    """The compiled kernels (default blocks) at a moderate size, bf16, against the float32 reference."""
    shape = (2, 2048, 2000, 8, 2, head_dim)  # GQA; the key length is not a block multiple
    block_mask = GPU_PATTERNS[pattern](2048, 2000)
    q, k, v, cotangent = make_inputs(shape, jnp.bfloat16, seed=16)
    ours = functools.partial(pf.flash_attention, is_causal=is_causal, implementation="pallas", block_mask=block_mask)
    ref = lambda q, k, v: pf.attention_reference(
        q, k, v, scale=head_dim**-0.5, is_causal=is_causal, block_mask=block_mask
    )[0]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(ours(q, k, v), ref(*f32), jnp.bfloat16)
    loss = lambda fn, q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32))
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(*f32)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, jnp.bfloat16, table=GRADIENT, what=f"d{name}")
