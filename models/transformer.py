"""The Transformer block every model shares: pre-norm, rotary embeddings, MHA/GQA, GELU or SwiGLU MLP.

The attention is one config field: "flash" (`pallas_flash.flax`), "dense" (Flax's own
`nnx.dot_product_attention`) or any callable with Flax's `attention_fn` signature. Attention holds no
parameters, so parameters and their initialisation do not depend on that choice: one checkpoint runs with
either. On a device mesh (`mesh`) flash attention runs inside `shard_map` as ring attention over the sequence
(`pallas_flash.parallel`); everything else is sharded by GSPMD from the inputs' shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from models.kv_cache import CacheStep, LayerCache
from pallas_flash.api import IMPLEMENTATIONS
from pallas_flash.decode import MAX_QUERY_LEN, flash_decode
from pallas_flash.flax import make_attention_fn
from pallas_flash.parallel import LAYOUTS, context_parallel_attention, zigzag_order

NORMS = ("rmsnorm", "layernorm")
MLPS = ("swiglu", "gelu")
ATTENTIONS = ("flash", "dense")
# The mesh axes a sharded model runs on: the batch is split along DATA_AXIS, each sequence along CONTEXT_AXIS.
DATA_AXIS, CONTEXT_AXIS = "data", "context"
ROPE_BASE = 10_000.0
INIT_STD = 0.02  # GPT-2's initialiser; residual projections are further scaled by 1/sqrt(2 * num_layers)
# Vocabularies up to this size look tokens up by a one-hot matmul, not a gather. A gather's gradient is a
# scatter-add, and on a GPU a scatter-add with many repeats of few tokens (bytes of text: spaces, "e") is
# serialised by atomics on the same rows: on the H100 it took 41-76 ms of a 47-91 ms step of the trainer's
# `small` GPT (byte vocabulary, bf16), ten times its flash attention
# (tools/train_step_breakdown.py). The matmul's gradient is a matmul: well under 1 ms there.
ONE_HOT_MAX_VOCAB = 4096


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The fields every model's config shares (GPTConfig, EncoderConfig, ViTConfig extend it)."""

    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    embed_dim: int = 64
    mlp_dim: int = 256
    dropout_rate: float = 0.0
    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    attention: str | Callable = "flash"
    attention_implementation: str | None = None
    # flash only: False lets the backward sum dQ with float32 atomics where that is faster (the one-pass
    # Hopper backward at head_dim 64: fwd+bwd 1.06-1.09x cuDNN on the H100, the deterministic 0.93-1.03x);
    # gradients then differ in their last bits from run to run.
    deterministic_gradients: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    # None: the query/key head_dim (embed_dim / num_heads); else the value heads' own width (as DeepSeek's MLA:
    # query/key 192, value 128), which the attention output and its projection take.
    value_head_dim: int | None = None
    # None: one device. A mesh with axes ("data", "context"): inputs arrive with the batch split along "data"
    # and the sequence along "context", and flash attention runs on each device's shard as ring attention.
    mesh: Mesh | None = None
    # The order of the sequence on a mesh's context axis: "contiguous" (natural order, device r holds the r-th
    # slice) or "zigzag" (inputs permuted with `pallas_flash.parallel.to_zigzag` over the axis's size, outputs
    # in that order too: every device gets the same causal work, 1.45x the contiguous ring's speed on 2 GPUs).
    # The default keeps natural order; the trainer permutes its batches and asks for "zigzag".
    context_layout: str = "contiguous"

    def __post_init__(self):
        require_positive_ints(self, "num_layers", "num_heads", "num_kv_heads", "embed_dim", "mlp_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads is {self.num_kv_heads}; num_heads {self.num_heads} must be a multiple of it"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} must be a multiple of num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim (embed_dim / num_heads) is {self.head_dim}; rotary embeddings need it even")
        if self.value_head_dim is not None:
            require_positive_ints(self, "value_head_dim")
            if self.value_head_dim != self.head_dim and self.attention == "dense":
                raise ValueError(
                    f"value_head_dim {self.value_head_dim} differs from head_dim {self.head_dim}: Flax's dense "
                    "attention (attention='dense') takes one head_dim; use 'flash' or a callable"
                )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
        if not callable(self.attention) and self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention must be one of {ATTENTIONS} or a callable with Flax's attention_fn "
                f"signature, got {self.attention!r}"
            )
        if self.attention_implementation not in (None, *IMPLEMENTATIONS):
            raise ValueError(
                f"attention_implementation must be None or one of {IMPLEMENTATIONS}, "
                f"got {self.attention_implementation!r}"
            )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be 'float32', 'bfloat16' or 'float16', got {value!r}")
        for name in ("remat", "deterministic_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mesh is not None and set(self.mesh.axis_names) != {DATA_AXIS, CONTEXT_AXIS}:
            raise ValueError(f"mesh must have the axes {(DATA_AXIS, CONTEXT_AXIS)}, got {tuple(self.mesh.axis_names)}")
        if self.context_layout not in LAYOUTS:
            raise ValueError(f"context_layout must be one of {LAYOUTS}, got {self.context_layout!r}")
        if self.context_layout == "zigzag" and self.attention != "flash":
            raise ValueError(
                f"context_layout 'zigzag' needs attention='flash' (the ring knows the permutation), got "
                f"{self.attention!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def v_head_dim(self) -> int:
        """The value heads' width: value_head_dim, or head_dim."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def context_shards(self) -> int:
        """How many devices split each sequence: the mesh's context axis, 1 without a mesh."""
        return 1 if self.mesh is None else self.mesh.shape[CONTEXT_AXIS]

    @property
    def permutes_sequences(self) -> bool:
        """Whether inputs arrive in zig-zag order (context_layout "zigzag" over more than one device)."""
        return self.context_layout == "zigzag" and self.context_shards > 1

    def sequence_positions(self, seq: int):
        """The global positions of a [.., seq] input's tokens, a NumPy int32 [seq] (None: 0..seq-1, natural
        order). NumPy, not a device array: the trainer permutes every batch with it on the host, where reading a
        device array back would wait for the queued steps."""
        if not self.permutes_sequences:
            return None
        return zigzag_order(seq, self.context_shards).astype(np.int32)

    def attention_fn(self) -> Callable:
        """The configured attention as a Flax `attention_fn`."""
        if self.attention == "flash" and self.mesh is not None:
            return functools.partial(
                _context_parallel_attention_fn,
                mesh=self.mesh,
                layout=self.context_layout,
                implementation=self.attention_implementation,
                deterministic=self.deterministic_gradients,
            )
        if self.attention == "flash":
            return make_attention_fn(
                implementation=self.attention_implementation, deterministic_gradients=self.deterministic_gradients
            )
        if self.attention == "dense":
            return nnx.dot_product_attention
        return self.attention


def _context_parallel_attention_fn(
    query, key, value, mask=None, *, mesh, layout, implementation, deterministic, dtype=None, is_causal=False, **unused
):
    """Flash attention of q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] sharded over
    `mesh`: the sequence along "context" in `layout` (the model's positions and rotary embeddings follow it), the
    batch along "data". Also with a context axis of one device: a Pallas kernel is opaque to GSPMD, which would
    gather its inputs onto every device, while `shard_map` gives each device its own batch shard. The model
    passes no mask (causality is `is_causal`) nor attention dropout (`Attention._attend`), the rest of Flax's
    `attention_fn` arguments (`unused`) keep their defaults."""
    if mask is not None:
        raise ValueError("attention on a mesh takes no mask: causality is is_causal")
    dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    return context_parallel_attention(
        query,
        key,
        value,
        mesh=mesh,
        axis=CONTEXT_AXIS,
        batch_axis=DATA_AXIS,
        is_causal=is_causal,
        layout=layout,
        implementation=implementation,
        deterministic=deterministic,
    )


def require_positive_ints(config, *names: str) -> None:
    """Raise a ValueError naming the first of `names` whose value on `config` is not a positive int."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _dense(cfg: TransformerConfig, in_features: int, out_features: int, *, rngs, std=INIT_STD):
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=False,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


def norm_layer(cfg: TransformerConfig, *, rngs) -> nnx.Module:
    cls = nnx.RMSNorm if cfg.norm == "rmsnorm" else nnx.LayerNorm
    return cls(
        cfg.embed_dim, epsilon=1e-6, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs
    )


def rotary(x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding of x [batch, seq, heads, head_dim] at positions 0..seq-1, or at `positions`
    (int [seq] or [batch, seq]: absolute positions, as a KV cache's decode steps need).

    Pairs (x[i], x[i + head_dim/2]) rotate by angle pos * base^(-2i/head_dim): the query-key dot product
    then depends on positions only through their difference. Angles in float32: bfloat16 positions are
    exact only up to 256.
    """
    seq, head_dim = x.shape[-3], x.shape[-1]
    freqs = ROPE_BASE ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2 / head_dim)
    positions = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = positions[..., None] * freqs  # [(batch,) seq, head_dim / 2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # [(batch,) seq, 1, head_dim / 2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head or grouped-query self-attention with rotary embeddings; the attention_fn is pluggable."""

    def __init__(self, cfg: TransformerConfig, *, is_causal: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        self.is_causal = is_causal
        self.attention_fn = cfg.attention_fn()
        d, dv, h = cfg.head_dim, cfg.v_head_dim, cfg.num_heads
        self.query = _dense(cfg, cfg.embed_dim, h * d, rngs=rngs)
        self.key = _dense(cfg, cfg.embed_dim, cfg.num_kv_heads * d, rngs=rngs)
        self.value = _dense(cfg, cfg.embed_dim, cfg.num_kv_heads * dv, rngs=rngs)
        self.out = _dense(cfg, h * dv, cfg.embed_dim, rngs=rngs, std=INIT_STD / math.sqrt(2 * cfg.num_layers))

    def _project(self, x: jax.Array, positions: jax.Array | None = None):
        """q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim] and v [batch, seq, kv_heads,
        v_head_dim], q and k rotated."""
        cfg = self.cfg
        batch, seq, _ = x.shape
        q = self.query(x).reshape(batch, seq, cfg.num_heads, cfg.head_dim)
        k = self.key(x).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        v = self.value(x).reshape(batch, seq, cfg.num_kv_heads, cfg.v_head_dim)
        return rotary(q, positions), rotary(k, positions), v

    def _attend(self, q, k, v, mask):
        # Dropout lives on the residual branches, not on the attention weights, so a model with dropout
        # still runs the flash kernels (the same call nnx.MultiHeadAttention makes, with dropout_rate 0).
        return self.attention_fn(
            q,
            k,
            v,
            mask=mask,
            dropout_rng=None,
            dropout_rate=0.0,
            broadcast_dropout=True,
            deterministic=True,
            dtype=jnp.dtype(self.cfg.dtype),
            precision=None,
            module=None,
            is_causal=self.is_causal,
        )

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """x [batch, seq, embed_dim]; mask broadcastable to [batch, heads, seq, seq] (True = attend)."""
        batch, seq, _ = x.shape
        out = self._attend(*self._project(x, self.cfg.sequence_positions(seq)), mask)
        return self.out(out.reshape(batch, seq, self.cfg.num_heads * self.cfg.v_head_dim))

    def cached(self, x: jax.Array, layer: LayerCache, step: CacheStep) -> tuple[jax.Array, LayerCache]:
        """Causal self-attention of x [batch, seq, embed_dim] (tokens at `step.positions`) with a KV cache:
        their keys and values are written into `layer`, then a prefill (tokens from position 0) attends
        with the configured attention, a decode step or an appended chunk with `flash_decode` over the cache."""
        if self.cfg.permutes_sequences:
            raise ValueError(
                "the KV cache keeps tokens in natural order; a model with context_layout 'zigzag' on a mesh takes "
                "them permuted: generate with the same parameters in a model without the mesh (or contiguous)"
            )
        batch, seq, _ = x.shape
        q, k, v = self._project(x, step.positions)
        layer = layer.write(k, v, step)
        if step.prefill:
            out = self._attend(q, k, v, None)
        else:
            out = _decode_in_pieces(q, layer, step)
        return self.out(out.reshape(batch, seq, self.cfg.num_heads * self.cfg.v_head_dim)), layer


def _decode_in_pieces(q: jax.Array, layer: LayerCache, step: CacheStep) -> jax.Array:
    """flash_decode of q [batch, seq, heads, head_dim] (at step.positions, their keys already in `layer`) in
    pieces of at most MAX_QUERY_LEN queries, as many as divide seq (one piece for a decode step): piece i's
    queries sit at the end of the first step.lengths - seq + (i + 1) * piece keys, so each sees its own
    causal prefix even though the whole chunk's keys are already written."""
    batch, seq, heads, dim = q.shape
    dim_v = layer.values.shape[-1]
    if seq <= MAX_QUERY_LEN:
        return flash_decode(q, layer.keys, layer.values, lengths=step.lengths, block_table=step.block_table)
    piece = max(p for p in range(1, MAX_QUERY_LEN + 1) if seq % p == 0)
    pieces = q.reshape(batch, seq // piece, piece, heads, dim).swapaxes(0, 1)
    ends = step.lengths - seq + piece * jnp.arange(1, seq // piece + 1, dtype=jnp.int32)[:, None]

    def attend(args):
        part, lengths = args
        return flash_decode(part, layer.keys, layer.values, lengths=lengths, block_table=step.block_table)

    return lax.map(attend, (pieces, ends)).swapaxes(0, 1).reshape(batch, seq, heads, dim_v)


class MLP(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.kind = cfg.mlp
        self.up = _dense(cfg, cfg.embed_dim, cfg.mlp_dim, rngs=rngs)
        self.gate = _dense(cfg, cfg.embed_dim, cfg.mlp_dim, rngs=rngs) if cfg.mlp == "swiglu" else None
        self.down = _dense(cfg, cfg.mlp_dim, cfg.embed_dim, rngs=rngs, std=INIT_STD / math.sqrt(2 * cfg.num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kind == "swiglu":
            return self.down(nnx.silu(self.gate(x)) * self.up(x))
        return self.down(nnx.gelu(self.up(x)))


class Block(nnx.Module):
    """x + Attention(Norm(x)), then x + MLP(Norm(x)); dropout on each branch's output."""

    def __init__(self, cfg: TransformerConfig, *, is_causal: bool, rngs: nnx.Rngs):
        self.attention_norm = norm_layer(cfg, rngs=rngs)
        self.attention = Attention(cfg, is_causal=is_causal, rngs=rngs)
        self.mlp_norm = norm_layer(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool = True):
        """x [batch, seq, embed_dim] -> [batch, seq, embed_dim]."""
        x = x + self.dropout(self.attention(self.attention_norm(x), mask), deterministic=deterministic)
        return x + self.dropout(self.mlp(self.mlp_norm(x)), deterministic=deterministic)

    def cached(self, x: jax.Array, layer: LayerCache, step: CacheStep) -> tuple[jax.Array, LayerCache]:
        """The deterministic block with a KV cache (`Attention.cached`)."""
        attended, layer = self.attention.cached(self.attention_norm(x), layer, step)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), layer


class Stack(nnx.Module):
    """num_layers Blocks, each optionally rematerialised (activations recomputed in the backward)."""

    def __init__(self, cfg: TransformerConfig, *, is_causal: bool, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.blocks = nnx.List([Block(cfg, is_causal=is_causal, rngs=rngs) for _ in range(cfg.num_layers)])

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool = True):
        for block in self.blocks:
            if self.remat:
                x = _checkpointed(block, x, mask, deterministic=deterministic)
            else:
                x = block(x, mask, deterministic=deterministic)
        return x


def _checkpointed(block: Block, x, mask, *, deterministic: bool):
    """block(x) under `jax.checkpoint`, the block passed in as state. Only dropout changes state (its RNG
    counts), so only then is that state written back: a deterministic call then also works inside plain
    jax.grad/vmap over a merged model, where `nnx.remat` would try to write back every variable."""
    graphdef, state = nnx.split(block)

    def pure(state, x, mask):
        inner = nnx.merge(graphdef, state)
        return inner(x, mask, deterministic=deterministic), nnx.state(inner, nnx.RngState)

    x, rng_state = jax.checkpoint(pure)(state, x, mask)
    if not deterministic:
        nnx.update(block, rng_state)
    return x


def lookup_rows(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """table [vocab, dim], tokens int [...] -> table[tokens] in `dtype`, exactly as `nnx.Embed` gives them
    (one term per output): by a one-hot matmul for vocabularies up to ONE_HOT_MAX_VOCAB (why: there), else
    by a gather of the table in its own dtype, so the gradient's scatter-add is not in a 16-bit dtype."""
    vocab = table.shape[0]
    if vocab <= ONE_HOT_MAX_VOCAB:
        # In the table's dtype at full precision: the rows come out exact, and the gradient (a matmul of the
        # one-hot and the cotangents) is summed and returned in that dtype, not rounded to a 16-bit one.
        one_hot = jax.nn.one_hot(tokens, vocab, dtype=table.dtype)
        return jnp.einsum("...v,vd->...d", one_hot, table, precision=jax.lax.Precision.HIGHEST).astype(dtype)
    return jnp.take(table, tokens, axis=0).astype(dtype)


class TiedTokenModel(nnx.Module):
    """Token embedding, a stack of blocks, a final norm and the tied output embedding: the body GPT and the
    encoder share. Subclasses decide causality and the mask."""

    def __init__(self, config, *, is_causal: bool, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.embed_dim,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            embedding_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.stack = Stack(config, is_causal=is_causal, rngs=rngs)
        self.norm = norm_layer(config, rngs=rngs)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens int [batch, seq] -> embeddings [batch, seq, embed_dim] in the compute dtype."""
        return lookup_rows(self.embed.embedding[...], tokens, jnp.dtype(self.config.dtype))

    def logits(self, tokens: jax.Array, mask: jax.Array | None, *, deterministic: bool) -> jax.Array:
        """tokens int [batch, seq] -> logits float32 [batch, seq, vocab_size]."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"tokens have seq {tokens.shape[1]} > max_seq_len {self.config.max_seq_len}")
        x = self.dropout(self.embed_tokens(tokens), deterministic=deterministic)
        x = self.norm(self.stack(x, mask, deterministic=deterministic))
        # Tied output embedding, in float32: logits feed a softmax over the whole vocabulary.
        table = self.embed.embedding[...].astype(jnp.float32)
        return jnp.einsum("bsd,vd->bsv", x.astype(jnp.float32), table)
