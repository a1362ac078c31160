"""flash vs Flax dense (bf16 logits) vs dense with fp32 logits+softmax: same seed, data, steps (CPU, bf16)."""
import sys, pathlib, json
import jax, jax.numpy as jnp
import flax.nnx as nnx
from train.config import parse_args
from train import loop

orig = nnx.dot_product_attention

def dense_fp32(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
               dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
               promote_dtype=None, is_causal=False):
    d = query.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    if is_causal:
        T, S = logits.shape[-2:]
        logits = jnp.where(jnp.tril(jnp.ones((T, S), bool)), logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, value, preferred_element_type=jnp.float32).astype(value.dtype)

variant = sys.argv[1]
cfg = parse_args(sys.argv[2:])
if variant == "dense_fp32":
    nnx.dot_product_attention = dense_fp32
att = "flash" if variant == "flash" else "dense"
r = loop.train(cfg, att, pathlib.Path(f"/tmp/agree/{variant}"))
print(json.dumps({"variant": variant, "losses": r.losses, "evals": r.evals, "tok_s": r.tokens_per_s}))
