"""What a benchmark runs: a problem (`Point`), its random inputs, and the jitted function of each pass.

Passes: fwd = the attention; bwd = the VJP alone, on residuals saved by a forward run beforehand; fwdbwd =
the attention and its VJP of a cotangent (out, then dq, dk, dv), as PyTorch's autograd.grad from the output
computes it: no loss reduction beside the attention. FLOPs: 4*B*H*Nq*Nk*D for fwd
(2*B*H*Nq*Nk*(D + Dv) with a value head_dim Dv of its own; halved when causal), 2.5x that for bwd and 3.5x for
fwdbwd.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

PASSES = ("fwd", "bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
# The FlashAttention paper's figure 3 keeps the work per point comparable: batch * seq = 16k tokens,
# heads * head_dim = 2048. The sweep and bar suites and the tools use these shapes.
ANCHOR_TOKENS, ANCHOR_WIDTH = 16384, 2048


@dataclasses.dataclass(frozen=True)
class Point:
    """One problem: [batch, seq_q, heads, head_dim] queries against [batch, seq_k, kv_heads, head_dim] keys, and
    values [batch, seq_k, kv_heads, head_dim_v] (None: head_dim)."""

    suite: str
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str
    passes: tuple = PASSES
    timed: bool = True  # the memory suite compiles, checks and measures bytes, but does not time
    pattern: str | None = None  # block-sparse points: the BlockMask pattern (benchmarks/impls.block_mask_of)
    density: float | None = None  # ... and its target density
    head_dim_v: int | None = None  # value's head_dim where it has its own (MLA: 192 / 128)

    @property
    def value_head_dim(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def key(self) -> str:
        sparse = f"-{self.pattern}{self.density:g}" if self.pattern else ""
        return (
            f"{self.suite}/b{self.batch}-q{self.seq_q}-k{self.seq_k}-h{self.heads}-kvh{self.kv_heads}"
            f"-d{self.head_dim}{f'-dv{self.head_dim_v}' if self.head_dim_v else ''}-c{int(self.causal)}-{self.dtype}"
            f"{sparse}"
        )

    def dense_key(self) -> str:
        """The key of this point with a full block mask: the baseline of `ratio_to_dense_same_impl`."""
        return dataclasses.replace(self, pattern="full", density=1.0).key()

    def size(self) -> int:
        return self.batch * self.heads * self.seq_q * self.seq_k * self.head_dim


def anchor_point(
    suite: str,
    seq: int,
    head_dim: int,
    causal: bool,
    dtype: str = "bfloat16",
    *,
    tokens: int = ANCHOR_TOKENS,
    width: int = ANCHOR_WIDTH,
    **kw,
) -> Point:
    """A square point at the anchor shapes: batch = tokens / seq, heads = width / head_dim."""
    heads = max(1, width // head_dim)
    return Point(suite, max(1, tokens // seq), seq, seq, heads, heads, head_dim, causal, dtype, **kw)


def fwd_flops(point: Point, density: float = 1.0) -> float:
    """FLOPs of one forward at this point, 2*B*H*Nq*Nk*(D + Dv) (S = Q K^T, then P V), halved when causal;
    `density`: the fraction of blocks a block mask computes."""
    causal = 2 if point.causal else 1
    widths = point.head_dim + point.value_head_dim
    return 2.0 * point.batch * point.heads * point.seq_q * point.seq_k * widths / causal * density


def random_inputs(point: Point, seed: int, dtype=None):
    """q, k, v and a cotangent for `point`, standard normal (never zeros: they hide unwritten outputs), in
    `dtype` (default: the point's). Threefry gives the same numbers on every backend, so every process (and
    every implementation) draws the same inputs for the same seed."""
    dtype = DTYPES[point.dtype] if dtype is None else dtype
    shapes = [
        (point.batch, point.seq_q, point.heads, point.head_dim),
        (point.batch, point.seq_k, point.kv_heads, point.head_dim),
        (point.batch, point.seq_k, point.kv_heads, point.value_head_dim),
        (point.batch, point.seq_q, point.heads, point.value_head_dim),
    ]
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(key, s, jnp.float32).astype(dtype) for key, s in zip(keys, shapes)]


def pass_function(fn, pass_: str, extra=()):
    """The jitted function of one pass of `fn` ((q, k, v, *extra) -> out), and how to turn (q, k, v, ct) into its
    arguments. `extra`: what `fn` reads besides q, k and v (a bias, a mask, the arrays a score_mod closes over),
    passed as arguments so that they are not constants compiled into the executable; not differentiated."""
    if pass_ == "fwd":
        return jax.jit(fn), lambda q, k, v, ct: (q, k, v, *extra)
    if pass_ == "fwdbwd":

        def forward_backward(q, k, v, ct, *extra):
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *extra), q, k, v)
            return out, vjp(ct.astype(out.dtype))

        return jax.jit(forward_backward), lambda q, k, v, ct: (q, k, v, ct, *extra)
    if pass_ == "bwd":
        # The VJP alone. jax.vjp's function is a pytree holding the forward's residuals, so it can be an argument
        # of a jitted function; the residuals come from one forward run per input set, untimed.
        forward = jax.jit(lambda q, k, v, *extra: jax.vjp(lambda q, k, v: fn(q, k, v, *extra), q, k, v))
        return jax.jit(lambda vjp, ct: vjp(ct)), lambda q, k, v, ct: (forward(q, k, v, *extra)[1], ct)
    raise ValueError(f"unknown pass {pass_!r}; choose from {', '.join(PASSES)}")


def compile_pass(fn, pass_: str, input_sets, extra=()):
    """`fn`'s pass compiled for these (q, k, v, cotangent) input sets (and `extra`, as in `pass_function`);
    returns (compiled, argument sets)."""
    jitted, make_args = pass_function(fn, pass_, extra)
    arg_sets = [make_args(*x) for x in input_sets]
    return jitted.lower(*arg_sets[0]).compile(), arg_sets


def outputs(pass_: str, result):
    """What a pass returns that is checked: the output (fwd) or (dq, dk, dv)."""
    return result[1] if pass_ == "fwdbwd" else result
