"""The configuration one call passes to every implementation: the portable kernels' blocks, the XLA chunked
path's key chunk, and the Hopper kernels' tiles, as a frozen dataclass passed statically."""

from __future__ import annotations

import dataclasses

from pallas_flash.hopper.config import H100_SHARED_MEMORY, HopperBwdConfig, HopperConfig


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch parameters of the portable Pallas kernels and of the XLA chunked path.

    Attributes:
      block_q, block_kv, num_warps, num_stages: forward kernel (a program owns block_q queries and loops
        over key blocks of block_kv).
      block_q_dkv, block_kv_dkv, num_warps_dkv, num_stages_dkv: dK/dV kernel (a program owns block_kv_dkv
        keys and loops over query blocks of block_q_dkv).
      block_q_dq, block_kv_dq, num_warps_dq, num_stages_dq: dQ kernel (a program owns block_q_dq queries
        and loops over key blocks of block_kv_dq).
      xla_block_kv: key chunk of the XLA chunked path (its memory is O(q_len * xla_block_kv)).
      hopper: tiles of the Hopper (Mosaic GPU) forward kernel; None: `HopperConfig.default(head_dim)`.
      hopper_bwd: tiles of the Hopper backward kernels; None: `HopperBwdConfig.default` for the call's
        head_dim, key length and causality, with `flash_attention`'s `deterministic`.
    num_warps and num_stages are Triton launch parameters; num_stages is the software-pipelining depth of
    the key (or query) loop.
    """

    block_q: int = 128
    block_kv: int = 128
    num_warps: int = 8
    num_stages: int = 3
    block_q_dkv: int = 64
    block_kv_dkv: int = 128
    num_warps_dkv: int = 8
    num_stages_dkv: int = 3
    block_q_dq: int = 128
    block_kv_dq: int = 64
    num_warps_dq: int = 8
    num_stages_dq: int = 3
    xla_block_kv: int = 512
    hopper: HopperConfig | None = None
    hopper_bwd: HopperBwdConfig | None = None

    def __post_init__(self):
        if self.hopper is not None and not isinstance(self.hopper, HopperConfig):
            raise TypeError(f"KernelConfig.hopper must be a HopperConfig or None, got {type(self.hopper).__name__}")
        if self.hopper_bwd is not None and not isinstance(self.hopper_bwd, HopperBwdConfig):
            raise TypeError(
                f"KernelConfig.hopper_bwd must be a HopperBwdConfig or None, got {type(self.hopper_bwd).__name__}"
            )
        for field in dataclasses.fields(self):
            if field.name in ("hopper", "hopper_bwd"):
                continue
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KernelConfig.{field.name} must be a positive int, got {value!r}")
            if field.name.startswith(("block_", "num_warps")) and not _is_power_of_two(value):
                raise ValueError(f"KernelConfig.{field.name} must be a power of two, got {value}")
            if field.name.startswith("block_") and field.name != "xla_block_kv" and value < 16:
                raise ValueError(f"KernelConfig.{field.name} must be at least 16 (a tensor-core tile), got {value}")

    @classmethod
    def default(
        cls, head_dim: int, itemsize: int = 2, shared_memory_bytes: int = H100_SHARED_MEMORY, score_tile_bytes: int = 0
    ) -> KernelConfig:
        """The fastest variants measured on the H100 for 2-byte inputs (docs/performance.md), shrunk
        until their pipelined tiles fit `shared_memory_bytes` at this `itemsize` (float32 doubles the tiles;
        smaller GPUs have less shared memory). `score_tile_bytes`: bytes per logit of the score-modifier
        tiles streamed beside K and V (a bias or mask spanning both queries and keys; 0 without)."""
        return _tuned(head_dim).fit_shared_memory(
            power_of_two_head_dim(head_dim), itemsize, shared_memory_bytes, score_tile_bytes
        )

    def shared_memory(self, head_dim: int, itemsize: int, score_tile_bytes: int = 0) -> dict:
        """Estimated bytes of shared memory per kernel: num_stages copies of the tiles its loop streams
        (K and V in the forward and dQ kernels, Q and dO in the dK/dV kernel, and a [block_q, block_kv]
        bias/mask tile of `score_tile_bytes` per logit) plus the tiles it keeps resident (Q; K and V; Q and
        dO), which the matmuls may stage through shared memory too."""
        row = head_dim * itemsize
        return {
            "forward": (self.num_stages * 2 * self.block_kv + self.block_q) * row
            + self.num_stages * self.block_q * self.block_kv * score_tile_bytes,
            "dkdv": (self.num_stages_dkv * 2 * self.block_q_dkv + 2 * self.block_kv_dkv) * row
            + self.num_stages_dkv * self.block_q_dkv * self.block_kv_dkv * score_tile_bytes,
            "dq": (self.num_stages_dq * 2 * self.block_kv_dq + 2 * self.block_q_dq) * row
            + self.num_stages_dq * self.block_q_dq * self.block_kv_dq * score_tile_bytes,
        }

    def fit_shared_memory(self, head_dim: int, itemsize: int, budget: int, score_tile_bytes: int = 0) -> KernelConfig:
        """Fewer stages (down to 2), then smaller streamed blocks, then smaller resident blocks, until every
        kernel's estimate fits `budget`."""
        config = self
        shrinkable = {
            "forward": ("num_stages", "block_kv", "block_q"),
            "dkdv": ("num_stages_dkv", "block_q_dkv", "block_kv_dkv"),
            "dq": ("num_stages_dq", "block_kv_dq", "block_q_dq"),
        }
        for kernel, (stages, streamed, resident) in shrinkable.items():
            while config.shared_memory(head_dim, itemsize, score_tile_bytes)[kernel] > budget:
                if getattr(config, stages) > 2:
                    change = {stages: getattr(config, stages) - 1}
                elif getattr(config, streamed) > 16:
                    change = {streamed: getattr(config, streamed) // 2}
                elif getattr(config, resident) > 16:
                    change = {resident: getattr(config, resident) // 2}
                else:
                    break
                config = dataclasses.replace(config, **change)
        return config


def power_of_two_head_dim(head_dim: int) -> int:
    """The width the portable kernels' tiles hold a head_dim at: the next power of two, at least 16 (tensor-core
    tiles take power-of-two shapes; zero columns change no logit and give zero output columns)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _tuned(head_dim: int) -> KernelConfig:
    if head_dim <= 64:
        return KernelConfig(
            block_q=64,
            block_kv=64,
            num_warps=4,
            num_stages=3,
            block_q_dkv=64,
            block_kv_dkv=64,
            num_warps_dkv=4,
            num_stages_dkv=3,
            block_q_dq=64,
            block_kv_dq=64,
            num_warps_dq=4,
            num_stages_dq=3,
        )
    if head_dim <= 128:
        return KernelConfig()
    # head_dim 256: smaller tiles so the accumulators fit in registers (not yet tuned on H100).
    return KernelConfig(
        block_q=64,
        block_kv=32,
        num_warps=4,
        num_stages=2,
        block_q_dkv=32,
        block_kv_dkv=32,
        num_warps_dkv=4,
        num_stages_dkv=2,
        block_q_dq=32,
        block_kv_dq=32,
        num_warps_dq=4,
        num_stages_dq=2,
    )
