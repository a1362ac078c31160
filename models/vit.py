"""A small Vision Transformer: non-overlapping patches, a class token, bidirectional blocks, a linear head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.transformer import INIT_STD, Stack, TransformerConfig, norm_layer, require_positive_ints


@dataclasses.dataclass(frozen=True)
class ViTConfig(TransformerConfig):
    """Positions come from the blocks' rotary embeddings over the flattened patch order (class token
    first), so the model has no position table."""

    image_size: int = 32
    patch_size: int = 4
    num_channels: int = 3
    num_classes: int = 10

    def __post_init__(self):
        super().__post_init__()
        require_positive_ints(self, "image_size", "patch_size", "num_channels", "num_classes")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(
        num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=64, mlp_dim=128, image_size=16, patch_size=4
    ),
    "small": ViTConfig(
        num_layers=6, num_heads=8, num_kv_heads=8, embed_dim=384, mlp_dim=1536, mlp="gelu", norm="layernorm"
    ),
    "vit_base": ViTConfig(
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        embed_dim=768,
        mlp_dim=3072,
        mlp="gelu",
        norm="layernorm",
        image_size=224,
        patch_size=16,
        num_classes=1000,
    ),
}


class ViT(nnx.Module):
    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        self.config = config
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        patch_features = config.patch_size**2 * config.num_channels
        self.patch_embed = nnx.Linear(
            patch_features,
            config.embed_dim,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )
        self.cls_token = nnx.Param(INIT_STD * jax.random.normal(rngs.params(), (1, 1, config.embed_dim), param_dtype))
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.stack = Stack(config, is_causal=False, rngs=rngs)
        self.norm = norm_layer(config, rngs=rngs)
        self.head = nnx.Linear(
            config.embed_dim,
            config.num_classes,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )

    def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """images float [batch, image_size, image_size, num_channels] -> logits float32 [batch, num_classes]."""
        cfg = self.config
        expected = (cfg.image_size, cfg.image_size, cfg.num_channels)
        if images.ndim != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"images must be [batch, {', '.join(map(str, expected))}], got shape {tuple(images.shape)}"
            )
        batch, p, n = images.shape[0], cfg.patch_size, cfg.image_size // cfg.patch_size
        # [batch, n, p, n, p, channels] -> [batch, n * n patches in row-major order, p * p * channels]
        patches = images.reshape(batch, n, p, n, p, cfg.num_channels).transpose(0, 1, 3, 2, 4, 5)
        x = self.patch_embed(patches.reshape(batch, n * n, p * p * cfg.num_channels))
        cls = jnp.broadcast_to(self.cls_token[...].astype(x.dtype), (batch, 1, cfg.embed_dim))
        x = self.dropout(jnp.concatenate([cls, x], axis=1), deterministic=deterministic)
        x = self.norm(self.stack(x, deterministic=deterministic))
        return self.head(x[:, 0].astype(jnp.float32))
