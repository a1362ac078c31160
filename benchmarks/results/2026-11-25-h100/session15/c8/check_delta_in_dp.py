import dataclasses, functools
import jax, jax.numpy as jnp, numpy as np
from pallas_flash import reference, masks
from pallas_flash.config import HopperBwdConfig
from pallas_flash.kernels import hopper_bwd, hopper_fwd
for shape, causal in (((2, 1000, 1000, 4, 2, 64), True), ((1, 777, 1531, 4, 1, 64), True), ((2, 1000, 1000, 4, 2, 64), False)):
    b, n, m, h, hk, d = shape
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (b, n, h, d), jnp.bfloat16); k = jax.random.normal(ks[1], (b, m, hk, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, m, hk, d), jnp.bfloat16); do = jax.random.normal(ks[3], (b, n, h, d), jnp.bfloat16)
    scale = d ** -0.5
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=causal)
    _, vjp = jax.vjp(lambda *x: reference.attention_reference(*x, scale=scale, band=masks.Band.of(causal, None))[0], *(x.astype(jnp.float32) for x in (q, k, v)))
    want = vjp(do.astype(jnp.float32))
    for dd in (0, 1):
        cfg = dataclasses.replace(HopperBwdConfig.default(64), delta_in_dp=dd)
        g = hopper_bwd.hopper_backward(q, k, v, out, lse, do, None, scale=scale, is_causal=causal, config=cfg)
        g2 = hopper_bwd.hopper_backward(q, k, v, out, lse, do, None, scale=scale, is_causal=causal, config=cfg)
        errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y))) for x, y in zip(g, want)]
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(g, g2))
        print(shape, causal, "delta_in_dp", dd, "max err dq/dk/dv", ["%.2e" % e for e in errs], "repeat", same, flush=True)
