"""dkv_overlap's step with delta_in_dp (session 16): gradients against the float32 reference with and without,
and bitwise repeatability, on ragged GQA shapes at head_dim 128 (the two passes' default, dkv_overlap on) and 64
(the two passes with dkv_overlap forced)."""
import dataclasses

import jax
import jax.numpy as jnp

from pallas_flash import masks, reference
from pallas_flash.config import HopperBwdConfig
from pallas_flash.kernels import hopper_bwd, hopper_fwd

TWO_PASS_OVERLAP = dict(dq_atomic=False, dq_ordered=False, dq_overlap=True, num_stages_dq=4, dkv_overlap=True,
                        num_stages_dkv=4)
CASES = [((2, 1000, 1000, 4, 2, 128), True), ((1, 1531, 513, 4, 4, 128), False), ((1, 777, 1531, 4, 1, 128), True),
         ((2, 1000, 1000, 4, 2, 64), True)]
for shape, causal in CASES:
    b, n, m, h, hk, d = shape
    ks = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(ks[0], (b, n, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, m, hk, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, m, hk, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, n, h, d), jnp.bfloat16)
    scale = d ** -0.5
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=causal)
    _, vjp = jax.vjp(lambda *x: reference.attention_reference(*x, scale=scale, band=masks.Band.of(causal, None))[0],
                     *(x.astype(jnp.float32) for x in (q, k, v)))
    want = vjp(do.astype(jnp.float32))
    for on in (False, True):
        config = dataclasses.replace(HopperBwdConfig.default(d), **TWO_PASS_OVERLAP, delta_in_dp=on)
        run = lambda: hopper_bwd.hopper_backward(q, k, v, out, lse, do, None, scale=scale, is_causal=causal,
                                                 config=config)
        grads, again = run(), run()
        errors = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y))) for x, y in zip(grads, want)]
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(grads, again))
        print(shape, "causal" if causal else "full", "delta_in_dp", int(on), "max err dq/dk/dv",
              ["%.2e" % e for e in errors], "repeatable", same, flush=True)
