"""Tile sizes and launch parameters, as a frozen dataclass passed statically to the kernels."""
from __future__ import annotations

import dataclasses


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch parameters of the portable Pallas kernels and of the XLA chunked path.

    Attributes:
      block_q, block_kv: forward tiles (a program owns block_q queries and loops over block_kv keys).
      block_q_dkv, block_kv_dkv: dK/dV kernel tiles (a program owns block_kv_dkv keys, loops over queries).
      block_q_dq, block_kv_dq: dQ kernel tiles (a program owns block_q_dq queries, loops over keys).
      num_warps, num_stages: forward launch parameters (Triton lowering).
      num_warps_bwd, num_stages_bwd: backward launch parameters.
      xla_block_kv: key chunk of the XLA chunked path (its memory is O(q_len * xla_block_kv)).
    """

    block_q: int = 128
    block_kv: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2
    xla_block_kv: int = 512

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KernelConfig.{field.name} must be a positive int, got {value!r}")
            if field.name.startswith(("block_", "num_warps")) and not _is_power_of_two(value):
                raise ValueError(f"KernelConfig.{field.name} must be a power of two, got {value}")
        for name in ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"):
            if getattr(self, name) < 16:
                raise ValueError(f"KernelConfig.{name} must be at least 16 (tensor-core tile), got {getattr(self, name)}")

    @classmethod
    def default(cls, head_dim: int) -> "KernelConfig":
        """Defaults per head_dim (tuned on H100; see pallas_flash/kernels/NOTES.md)."""
        if head_dim <= 64:
            return cls(block_q=128, block_kv=64, num_warps=4, num_stages=3,
                       block_q_dkv=64, block_kv_dkv=128, block_q_dq=128, block_kv_dq=64,
                       num_warps_bwd=8, num_stages_bwd=2)
        if head_dim <= 128:
            return cls()
        return cls(block_q=64, block_kv=32, num_warps=4, num_stages=2,
                   block_q_dkv=32, block_kv_dkv=64, block_q_dq=64, block_kv_dq=32,
                   num_warps_bwd=8, num_stages_bwd=1)
