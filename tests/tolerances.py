"""Per-dtype tolerances, stated once: relative Frobenius-norm error ||ours - ref|| / ||ref|| against the
float32 dense reference. The low-precision bounds are a few times the error a dense computation in that
dtype makes against the same reference (bf16 keeps 8 mantissa bits, fp16 11). Where the true value is
(near) zero, e.g. dq of a row that sees a single key, the norm is floored at an RMS of 1e-2, a hundredth
of the unit-normal inputs' scale."""

import jax.numpy as jnp
import numpy as np

OUTPUT = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
GRADIENT = {jnp.float32: 2e-4, jnp.bfloat16: 4e-2, jnp.float16: 8e-3}


def relative_error(ours, ref) -> float:
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(ours)), "non-finite values"
    floor = 1e-2 * np.sqrt(ref.size)
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), floor))


def assert_close(ours, ref, dtype, *, table=OUTPUT, what="output"):
    tol = table[jnp.dtype(dtype).type]
    err = relative_error(ours, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e} ({jnp.dtype(dtype).name})"
