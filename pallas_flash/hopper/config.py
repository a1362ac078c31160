"""Tiles of the Hopper (Mosaic GPU) kernels, as frozen dataclasses passed statically to them."""

from __future__ import annotations

import dataclasses

H100_SHARED_MEMORY = 227 * 1024  # per block, the sm90 opt-in maximum
NUM_CONSUMERS = 2  # compute warpgroups per CTA; a third warpgroup is the TMA producer
_SMEM_SLACK = 3072  # barriers and alignment (Mosaic GPU measured 2,648 bytes over our tiles)


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Tiles of the Hopper forward kernel.

    Attributes:
      block_q: query rows per consumer warpgroup (a CTA owns 2 * block_q rows); multiple of 64 (wgmma M).
      block_kv: keys per K/V block: 64, 128, 192 or 256 (the K of the P V wgmma comes in multiples of 64).
      num_stages: depth of the K/V shared-memory ring (>= 2).
      persistent: one CTA per SM loops over the query tiles (the ring and the ping-pong run on across tiles,
        and the next tile's Q loads during this one's epilogue) instead of one CTA per tile.
      overlap: FlashAttention-3's intra-warpgroup pipelining on top of the consumers' ping-pong: each step
        issues Q K_j^T, then P_{j-1} V_{j-1}, and computes block j's softmax while that P V runs (holds O,
        S_j and P_{j-1} in registers at once).
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    persistent: bool = False
    overlap: bool = False

    def __post_init__(self):
        if not isinstance(self.block_q, int) or self.block_q < 64 or self.block_q % 64:
            raise ValueError(f"HopperConfig.block_q must be a positive multiple of 64, got {self.block_q!r}")
        # block_kv is the contraction (K) of the P V wgmma, which Mosaic GPU takes in multiples of 64.
        if not isinstance(self.block_kv, int) or not 64 <= self.block_kv <= 256 or self.block_kv % 64:
            raise ValueError(f"HopperConfig.block_kv must be 64, 128, 192 or 256, got {self.block_kv!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"HopperConfig.num_stages must be an int >= 2, got {self.num_stages!r}")
        for name in ("persistent", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HopperConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0) -> int:
        """Shared memory of the forward at this (padded) head_dim and input itemsize; `tile_bytes`: bytes per
        logit of the dense bias and mask tiles that ride the K/V ring (`dense_ring_bytes`), 0 without them."""
        out_tile = self._q_tile_bytes(head_dim, itemsize) if self.separate_out(head_dim, itemsize, tile_bytes) else 0
        return self._smem_bytes_sharing_q(head_dim, itemsize, tile_bytes) + out_tile

    def separate_out(self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0) -> bool:
        """Whether the output tile gets its own shared memory (else it reuses Q's): a persistent CTA then
        loads the next tile's Q while it stores this one's output. Only where it fits (not at head_dim 256)."""
        with_out_tile = self._smem_bytes_sharing_q(head_dim, itemsize, tile_bytes) + self._q_tile_bytes(
            head_dim, itemsize
        )
        return self.persistent and with_out_tile <= H100_SHARED_MEMORY

    def fit_dense_tiles(self, head_dim: int, itemsize: int, tile_bytes: int) -> HopperConfig | None:
        """This config, or where its ring cannot also hold a dense bias/mask tile per stage (`tile_bytes` per
        logit) the first of: fewer stages (down to 2), then halved key blocks (down to 64), that fits; None
        where none does. The query tile and the schedule flags stay."""
        config = self
        while config.smem_bytes(head_dim, itemsize, tile_bytes) > H100_SHARED_MEMORY:
            if config.num_stages > 2:
                config = dataclasses.replace(config, num_stages=config.num_stages - 1)
            elif config.block_kv > 64:
                config = dataclasses.replace(config, block_kv=max(64, config.block_kv // 2 // 64 * 64))
            else:
                return None
        return config

    def _q_tile_bytes(self, head_dim: int, itemsize: int) -> int:
        return NUM_CONSUMERS * self.block_q * head_dim * itemsize

    def _smem_bytes_sharing_q(self, head_dim: int, itemsize: int, tile_bytes: int = 0) -> int:
        """Q (and the output in its place), the K/V ring with any dense tiles, the lse staging and the
        barriers."""
        kv_ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        dense = dense_ring_bytes(self.num_stages, NUM_CONSUMERS * self.block_q, self.block_kv, tile_bytes)
        lse = NUM_CONSUMERS * self.block_q * 4
        return self._q_tile_bytes(head_dim, itemsize) + kv_ring + dense + lse + _SMEM_SLACK

    @classmethod
    def default(cls, head_dim: int, kv_len: int | None = None, is_causal: bool = False) -> HopperConfig:
        """The fastest tiles measured on the H100 per padded head_dim (docs/performance.md).

        head_dim 64: 256-key blocks (fewer, longer wgmmas per softmax), but 128 for causal rows up to 1k
        (mostly diagonal blocks); persistent CTAs for short rows and causal rows up to 8k (a CTA's fixed cost
        dominates short rows; the folded order balances causal tiles), one CTA per tile elsewhere.
        head_dim 128: 128-key blocks, 2 stages (3 do not fit); rows up to 1k persistent unless causal; longer
        rows the overlap, one CTA per tile. head_dim 256: 64-key blocks (the only size that fits).
        Windows and segment ids take the same tiles."""
        known = kv_len is not None
        short = known and kv_len <= 1024
        if head_dim <= 64:
            if is_causal and short:
                return cls(block_q=64, block_kv=128, num_stages=3, persistent=True)
            return cls(
                block_q=64, block_kv=256, num_stages=2, persistent=short or (is_causal and known and kv_len <= 8192)
            )
        if head_dim <= 128:
            if short:
                return cls(block_q=64, block_kv=128, num_stages=2, persistent=not is_causal)
            return cls(block_q=64, block_kv=128, num_stages=2, persistent=False, overlap=True)
        return cls(block_q=64, block_kv=64, num_stages=2)


def dense_ring_bytes(num_stages: int, rows: int, cols: int, tile_bytes: int) -> int:
    """Shared memory of a ring of dense bias/mask tiles ([rows, cols] per stage, `tile_bytes` per element
    over the arrays it carries) and their "ready" barriers (8 bytes per stage and array, at most 2 arrays)."""
    if not tile_bytes:
        return 0
    return num_stages * (rows * cols * tile_bytes + 2 * 8)


_BWD_FLAGS = ("dq_atomic", "dq_ordered", "delta_in_dp", "dq_overlap", "dkv_overlap", "portable")  # the bool fields


@dataclasses.dataclass(frozen=True)
class HopperBwdConfig:
    """Tiles and variant of the Hopper backward (by default two passes: dK/dV, then dQ).

    Attributes:
      block_q_dkv: query rows per streamed Q/dO block of the dK/dV kernel; a multiple of 64 (the K of the
        dV += P^T dO and dK += dS^T Q wgmmas).
      block_kv_dkv: key rows per consumer warpgroup of the dK/dV kernel (a CTA owns 2 * block_kv_dkv keys);
        a multiple of 64 (wgmma M).
      num_stages_dkv: depth of the Q/dO shared-memory ring (>= 2).
      block_q_dq: query rows per consumer warpgroup of the dQ kernel (a CTA owns 2 * block_q_dq queries);
        a multiple of 64.
      block_kv_dq: keys per streamed K/V block of the dQ kernel; a multiple of 64 (the K of dQ += dS K).
      num_stages_dq: depth of the K/V shared-memory ring (>= 2).
      dq_atomic: one pass instead of two: the dK/dV kernel also computes each query block's dS K and adds it
        into a float32 dQ buffer with TMA reduce-adds (5 matmuls per tile instead of 7). Without dq_ordered
        the adds land in any order, so dQ is not bitwise repeatable. Under `jax.vmap` the vmapped axis is
        folded into the batch (the kernel writes a mutable array). At head_dim 64 it needs block_q_dkv >= 128.
        The *_dq fields apply to the two-pass dQ kernel only.
      dq_ordered: with dq_atomic only: the CTA of key tile t adds a query block's dQ only after every higher
        key tile that visits the block has added its own (a global int32 semaphore per (batch, query head,
        query block), waited on by a store warp of the producer), key tiles launched in descending order in
        L2-sized groups: dQ's float32 sums run in one fixed order (bitwise deterministic).
      delta_in_dp: the dK/dV kernel's dP^T accumulator starts at -delta instead of zeros, so its wgmma yields
        dP^T - delta directly and the per-query delta is not live beside P^T, dP^T, dK and dV (fewer register
        spills). Applies to the plain step and dkv_overlap's step, not to the ordered one pass's fused order.
      dq_overlap: the two-pass dQ kernel's intra-warpgroup pipelining: step j issues S_j and dP_j, then
        dQ += dS_{j-1} K_{j-1}, and computes dS_j while that product runs; each consumer holds two key blocks
        of the ring, so it wants num_stages_dq >= 3.
      dkv_overlap: the same pipelining in the two-pass dK/dV kernel (dK += dS^T_{t-1} Q_{t-1} runs while P^T_t
        is computed); wants num_stages_dkv >= 3. Does nothing under dq_atomic.
      portable: run the portable Pallas backward kernels after the Hopper forward instead (both read the same
        residuals); for comparison and for what the Hopper backward does not serve.
    """

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_stages_dkv: int = 2
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_stages_dq: int = 2
    dq_atomic: bool = False
    dq_ordered: bool = False
    delta_in_dp: bool = False
    dq_overlap: bool = False
    dkv_overlap: bool = False
    portable: bool = False

    def __post_init__(self):
        for name in _BWD_FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HopperBwdConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dq_ordered and not self.dq_atomic:
            raise ValueError(
                "HopperBwdConfig.dq_ordered orders the one-pass backward's dQ reduce-adds: it needs "
                "dq_atomic=True (the two-pass backward is deterministic already)"
            )
        for field in dataclasses.fields(self):
            if field.name in _BWD_FLAGS:
                continue
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"HopperBwdConfig.{field.name} must be an int, got {value!r}")
            if field.name.startswith("block_") and not (64 <= value <= 256 and value % 64 == 0):
                raise ValueError(f"HopperBwdConfig.{field.name} must be 64, 128, 192 or 256, got {value}")
            if field.name.startswith("num_stages") and value < 2:
                raise ValueError(f"HopperBwdConfig.{field.name} must be >= 2, got {value}")

    def smem_bytes_dkv(self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0) -> int:
        """Shared memory of the dK/dV kernel; `tile_bytes`: bytes per logit of the dense bias and mask tiles
        that ride its Q/dO ring (0 without them)."""
        dense = dense_ring_bytes(self.num_stages_dkv, NUM_CONSUMERS * self.block_kv_dkv, self.block_q_dkv, tile_bytes)
        k_and_v = 2 * NUM_CONSUMERS * self.block_kv_dkv * head_dim * itemsize
        ring = self.num_stages_dkv * (2 * self.block_q_dkv * head_dim * itemsize + 2 * self.block_q_dkv * 4)
        staging = 0
        if self.dq_atomic:  # both consumers' dS^T in one tile; two slots of dQ's float32 [block_q, D] in halves
            staging = (
                NUM_CONSUMERS * self.block_kv_dkv * self.block_q_dkv * itemsize + 2 * self.block_q_dkv * head_dim * 4
            )
        return k_and_v + ring + staging + dense + _SMEM_SLACK

    def smem_bytes_dq(self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0, dbias: bool = False) -> int:
        """Shared memory of the dQ kernel; `tile_bytes`: bytes per logit of the dense bias and mask tiles that
        ride its K/V ring (0 without them); `dbias`: with each consumer's float32 dS tile staged for dbias."""
        q_and_do = 2 * NUM_CONSUMERS * self.block_q_dq * head_dim * itemsize + 2 * NUM_CONSUMERS * self.block_q_dq * 4
        ring = self.num_stages_dq * 2 * self.block_kv_dq * head_dim * itemsize
        dense = dense_ring_bytes(self.num_stages_dq, NUM_CONSUMERS * self.block_q_dq, self.block_kv_dq, tile_bytes)
        staging = NUM_CONSUMERS * self.block_q_dq * self.block_kv_dq * 4 if dbias else 0
        return q_and_do + ring + dense + staging + _SMEM_SLACK

    def fit_dense_tiles(self, head_dim: int, itemsize: int, tile_bytes: int, dbias: bool) -> HopperBwdConfig | None:
        """The two passes at these tiles (the one pass takes no dense tiles), each pass whose ring cannot also hold
        a dense bias/mask tile per stage (`tile_bytes` per logit; `dbias`: the dQ kernel stages dS for dbias)
        shrunk: to 2 stages (without its overlap, which wants 3), then halved streamed blocks (down to 64);
        None where that does not fit."""
        config = dataclasses.replace(self, dq_atomic=False, dq_ordered=False)
        passes = (
            (lambda c: c.smem_bytes_dkv(head_dim, itemsize, tile_bytes), "dkv", "num_stages_dkv", "block_q_dkv"),
            (lambda c: c.smem_bytes_dq(head_dim, itemsize, tile_bytes, dbias), "dq", "num_stages_dq", "block_kv_dq"),
        )
        for needed, name, stages, block in passes:
            if needed(config) <= H100_SHARED_MEMORY:
                continue
            config = dataclasses.replace(config, **{stages: 2, f"{name}_overlap": False})
            while needed(config) > H100_SHARED_MEMORY:
                if getattr(config, block) == 64:
                    return None
                config = dataclasses.replace(config, **{block: max(64, getattr(config, block) // 2 // 64 * 64)})
        return config
        config = dataclasses.replace(config, num_stages_dkv=2, num_stages_dq=2, dq_overlap=False, dkv_overlap=False)
        while not config.fits(head_dim, itemsize, tile_bytes, dbias):
            if config.block_kv_dq == config.block_q_dkv == 64:
                return None
            config = dataclasses.replace(
                config,
                block_kv_dq=max(64, config.block_kv_dq // 2 // 64 * 64),
                block_q_dkv=max(64, config.block_q_dkv // 2 // 64 * 64),
            )
        return config

    @classmethod
    def default(
        cls, head_dim: int, deterministic: bool = True, kv_len: int | None = None, is_causal: bool = False
    ) -> HopperBwdConfig:
        """The fastest variant measured on the H100 per padded head_dim (docs/performance.md).

        head_dim 64: the one pass (dq_atomic) with ordered dQ adds unless deterministic=False, delta_in_dp;
        deterministic causal rows up to 2k keys (`kv_len`, `is_causal`: the call's) take the two passes,
        faster there. head_dim 128: the two passes with both overlaps over 4-stage rings (the one pass lost
        9-18%), delta_in_dp for causal rows up to 8k keys (slower on longer and non-causal rows)."""
        if head_dim <= 64:
            ordered_pays = not (is_causal and kv_len is not None and kv_len <= 2048)
            one_pass = not deterministic or ordered_pays
            return cls(
                block_q_dkv=128,
                block_kv_dkv=64,
                num_stages_dkv=2,
                block_q_dq=64,
                block_kv_dq=128,
                num_stages_dq=2,
                dq_atomic=one_pass,
                dq_ordered=deterministic and ordered_pays,
                delta_in_dp=True,
            )
        if head_dim <= 128:
            causal_up_to_8k = is_causal and kv_len is not None and kv_len <= 8192
            return cls(
                block_q_dkv=64,
                block_kv_dkv=64,
                num_stages_dkv=4,
                block_q_dq=64,
                block_kv_dq=64,
                num_stages_dq=4,
                dq_overlap=True,
                dkv_overlap=True,
                delta_in_dp=causal_up_to_8k,
            )
        # head_dim 256: K and V of 128 keys alone take 128 KiB of the dK/dV kernel's shared memory.
        raise ValueError(f"the Hopper backward takes head_dim <= 128, got {head_dim}")
