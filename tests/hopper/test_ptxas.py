"""What ptxas makes of the Hopper kernels on an H100 (needs the GPU: Mosaic GPU assembles at compile time): no
kernel variant reads a wgmma's accumulator registers while it is in flight, which ptxas answers by serializing
every wgmma of the kernel (its C7514 "Potential Performance Loss"; the results stay right, the kernel slows)."""

import os
import subprocess
import sys

import pytest

# Each case compiles the forward and backward of a causal call at its head_dim in a child process (ptxas's notes go
# to the process's stdout from C++, which only a child's pipe captures).
CHILD = """
import jax, jax.numpy as jnp
import pallas_flash as pf
from pallas_flash import mods
x = jnp.zeros((1, 1024, 2, {head_dim}), jnp.bfloat16)
kwargs = {kwargs}
loss = lambda q, k, v: pf.flash_attention(q, k, v, is_causal=True, implementation="mosaic", **kwargs).sum()
jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
"""
DOCUMENTS = "mods.document(jnp.arange(1024)[None] // 256)"
CASES = {  # name: (head_dim, flash_attention's keyword arguments)
    "plain": (128, "{}"),
    "soft_cap_program": (128, "dict(score_mod=mods.soft_cap(30.0))"),
    "alibi_program": (128, "dict(score_mod=mods.alibi(jnp.linspace(0.1, 0.3, 2)))"),
    "fixed_alibi_program": (128, "dict(alibi_slopes=jnp.linspace(0.1, 0.3, 2))"),  # per-query terms in both passes
    "key_bias_program": (128, "dict(score_mod=lambda s, b, h, q, k, t=jnp.ones((2, 1024)): s + t[h, k])"),
    "dropout": (128, "dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))"),
    "dense_bias": (128, "dict(bias=jnp.zeros((1, 1, 1024, 1024), jnp.bfloat16))"),
    "documents_and_soft_cap": (128, f"dict(mask_mod={DOCUMENTS}, score_mod=mods.soft_cap(30.0))"),
    "window_and_segment_ids": (128, "dict(local_window_size=(256, 0), segment_ids=jnp.arange(1024)[None] // 300)"),
    "head_dim_64_ordered_one_pass": (64, "{}"),
    "head_dim_64_program_and_dropout": (
        64,
        "dict(score_mod=mods.soft_cap(30.0), dropout_rate=0.1, dropout_rng=jax.random.key(0))",
    ),
    "head_dim_256_split_columns": (256, "{}"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_no_kernel_serializes_its_wgmmas(case):
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(head_dim=CASES[case][0], kwargs=CASES[case][1])],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    text = out.stdout + out.stderr
    assert "Used" in text, "no ptxas report: MOSAIC_GPU_DUMP_PTXAS had no effect"
    assert "C7514" not in text, [line for line in text.splitlines() if "C7514" in line]
