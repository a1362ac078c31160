"""Tile sizes and launch parameters, as a frozen dataclass passed statically to the kernels."""
from __future__ import annotations

import dataclasses


H100_SHARED_MEMORY = 227 * 1024  # per block, sm90 opt-in maximum
NUM_CONSUMERS = 2  # Hopper forward: compute warpgroups per CTA; a third warpgroup is the TMA producer
_HOPPER_SMEM_SLACK = 3072  # barriers and alignment (Mosaic GPU measured 2,648 bytes over our tiles)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Tiles of the Hopper forward kernel.

    Attributes:
      block_q: query rows per consumer warpgroup (a CTA owns 2 * block_q rows); multiple of 64 (wgmma M).
      block_kv: keys per K/V block: 64, 128, 192 or 256.
      num_stages: depth of the K/V shared-memory ring (>= 2).
      persistent: one CTA per SM loops over the query tiles (the K/V ring and the ping-pong run on across
        tiles, and the next tile's Q loads during this one's epilogue), instead of one CTA per tile
        (`default` picks it for short rows).
      overlap: FlashAttention-3's intra-warpgroup pipelining on top of the ping-pong between the consumers:
        each step issues Q K_j^T, then P_{j-1} V_{j-1}, and computes block j's softmax while that P V runs
        (`hopper_fwd.overlapped_blocks`). Holds O, S_j and P_{j-1} in registers at once. `default` turns it
        on at head_dim 128 for rows over 1k without masks, where the H100 measured it faster.
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

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        out_tile = self._q_tile_bytes(head_dim, itemsize) if self.separate_out(head_dim, itemsize) else 0
        return self._smem_bytes_sharing_q(head_dim, itemsize) + out_tile

    def separate_out(self, head_dim: int, itemsize: int = 2) -> bool:
        """Whether the output tile gets its own shared memory (else it reuses Q's): a persistent CTA then
        loads the next tile's Q while it stores this one's output. Only where it fits (not at head_dim 256)."""
        with_out_tile = self._smem_bytes_sharing_q(head_dim, itemsize) + self._q_tile_bytes(head_dim, itemsize)
        return self.persistent and with_out_tile <= H100_SHARED_MEMORY

    def _q_tile_bytes(self, head_dim: int, itemsize: int) -> int:
        return NUM_CONSUMERS * self.block_q * head_dim * itemsize

    def _smem_bytes_sharing_q(self, head_dim: int, itemsize: int) -> int:
        """Q (and the output in its place), the K/V ring, the lse staging and the barriers."""
        kv_ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        lse = NUM_CONSUMERS * self.block_q * 4
        return self._q_tile_bytes(head_dim, itemsize) + kv_ring + lse + _HOPPER_SMEM_SLACK

    @classmethod
    def default(cls, head_dim: int, kv_len: int | None = None, is_causal: bool = False) -> "HopperConfig":
        """Per padded head_dim (a multiple of 64), from the H100 sweeps in pallas_flash/kernels/NOTES.md.

        head_dim 64: 256-key blocks (fewer, longer wgmmas per softmax), except for causal rows up to 1k, where
        most blocks are diagonal and 128 wastes less. At 2k causal, 256 measured 1.040x cuDNN against 128's
        0.989x (paired sweep, sixth session). Persistent CTAs for short rows (kv_len <= 1024: a CTA's fixed
        cost of launch, first loads and epilogue is a large part of its time) and causal rows up to 8k (the
        folded order balances the unequal tiles); one CTA per tile for long non-causal rows (1-4% faster)
        and causal rows over 8k. FA3's intra-warpgroup overlap measured 4-12% slower here (its S and P need
        128-key blocks).
        head_dim 128: 128-key blocks, 2 stages (3 do not fit). Rows up to 1k: persistent CTAs unless causal,
        no overlap (unmeasured with it). Longer (or unknown) rows: the overlap, one CTA per tile, 3-6% faster
        than the previous defaults at five of the six anchor points and 1% slower at 2k causal.
        head_dim 256: 64-key blocks, one CTA per tile (unmeasured).
        Calls with a window or segment ids (or lengths) get the same tiles: their GPU tests passed with them
        (H100, 2026-11-23, tests/test_masks.py); their speed there is unmeasured."""
        known = kv_len is not None
        short = known and kv_len <= 1024
        if head_dim <= 64:
            if is_causal and short:
                return cls(block_q=64, block_kv=128, num_stages=3, persistent=True)
            return cls(block_q=64, block_kv=256, num_stages=2,
                       persistent=short or (is_causal and known and kv_len <= 8192))
        if head_dim <= 128:
            if short:
                return cls(block_q=64, block_kv=128, num_stages=2, persistent=not is_causal)
            return cls(block_q=64, block_kv=128, num_stages=2, persistent=False, overlap=True)
        return cls(block_q=64, block_kv=64, num_stages=2)


_BWD_FLAGS = ("dq_atomic", "dq_ordered", "delta_in_dp", "dq_overlap", "dkv_overlap")  # HopperBwdConfig's bool fields


@dataclasses.dataclass(frozen=True)
class HopperBwdConfig:
    """Tiles of the Hopper backward kernels (two passes: dK/dV, then dQ).

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
        into a float32 dQ buffer with TMA reduce-adds (5 matmuls per tile instead of 7). The order of those
        float32 additions varies from run to run (unless dq_ordered), so dQ is not bitwise deterministic.
        Under `jax.vmap` the
        vmapped axis is folded into the batch (the kernel writes into a mutable array, which Mosaic GPU's
        batching cannot carry). At head_dim 64 it needs block_q_dkv >= 128 (`hopper_bwd.dq_split`). On the
        H100 fwd+bwd 1.06-1.09x cuDNN at head_dim 64 (the two passes: 0.93-1.03x), 0.82-0.91x at 128 (the
        two passes: 0.92-1.10x) (pallas_flash/kernels/NOTES.md); `HopperBwdConfig.default` takes it at
        head_dim 64 (with dq_ordered unless deterministic=False). False (the field's default) keeps the
        deterministic separate dQ pass; the block_*_dq / num_stages_dq / dq_overlap fields apply to it only.
      dq_ordered: with dq_atomic only (ValueError otherwise): a bitwise deterministic one pass. The CTA of key
        tile t adds a query block's dQ only after every higher key tile that visits that block has added its
        own (one global int32 semaphore per (batch, query head, query block), waited on and signalled by a
        store warp of the producer, so the matmuls never wait on other CTAs), with key tiles launched in
        descending order in groups of (batch, kv head) pairs sized to keep their dQ in L2
        (`hopper_bwd.pairs_per_group`); dQ's float32 sums run in one fixed order. On the H100 at head_dim
        64, fwd+bwd 1.02-1.04x cuDNN non-causal and 0.99-1.00x causal at 8k and 16k keys: 3-8% behind
        dq_atomic alone, ahead of the two passes except at causal 2k (pallas_flash/kernels/NOTES.md,
        "Deterministic one-pass on the H100", "Order of the wgmmas"); the default for deterministic gradients
        at head_dim 64. False leaves dq_atomic's order free.
      delta_in_dp: the dK/dV kernel's dP^T accumulator starts at -delta (broadcast over the key rows) instead
        of zeros, so its wgmma yields dP^T - delta and dS^T = P^T * that: the per-query delta vector is no
        longer live beside P^T, dP^T, dK and dV when dS^T is formed, which trims the consumers' register
        spills. Applies to the plain step (`hopper_bwd._dkdv_kernel`'s `step` with the split wgmma order) and to
        dkv_overlap's step, not to the fused order (the ordered one pass on a full band). On the H100 at
        head_dim 64, causal, the ordered one pass fwd+bwd 1.029 / 1.014x cuDNN at 8k / 16k keys against 1.008
        / 0.998x without (one paired run, pallas_flash/kernels/NOTES.md "delta in dP's accumulator"), and the
        two passes' causal 2k 1.085-1.088x against 1.066-1.067x (two paired runs); the default at head_dim 64.
        At head_dim 128 (dkv_overlap's step), three paired runs: causal +3% at 2k and +4% at 8k keys, -0.5% at
        16k, non-causal -0.5-1.4% ("delta in dP's accumulator at head_dim 128"); the default there for causal
        rows up to 8k keys.
      dq_overlap: the two-pass dQ kernel's intra-warpgroup pipelining: step j issues S_j and dP_j, then
        dQ += dS_{j-1} K_{j-1}, and computes dS_j while that last product runs (`hopper_bwd._dq_kernel`). Holds
        dQ, S_j, dP_j and dS_{j-1} in registers at once, and each consumer two key blocks of the ring, which
        therefore wants num_stages_dq >= 3 (on the H100 at head_dim 128 fwd+bwd +1-4% over the plain
        kernel with 4 stages, 2-13% worse with 2; NOTES.md "dQ kernel: intra-warpgroup overlap"). The
        default at head_dim 128. Like the other *_dq fields it does nothing under dq_atomic.
      dkv_overlap: the same pipelining in the two-pass dK/dV kernel: step t issues S^T_t, then
        dK += dS^T_{t-1} Q_{t-1}, and computes P^T_t while that product runs (`hopper_bwd._dkdv_kernel`). Each
        consumer holds two Q/dO blocks of the ring (so num_stages_dkv >= 3) and dS^T_{t-1} on top of dK, dV,
        P^T and dP^T. The default at head_dim 128, causal or not (with 4 stages). Does nothing under dq_atomic
        (the one pass has its own step).
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

    def __post_init__(self):
        for name in _BWD_FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HopperBwdConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dq_ordered and not self.dq_atomic:
            raise ValueError("HopperBwdConfig.dq_ordered orders the one-pass backward's dQ reduce-adds: it needs "
                             "dq_atomic=True (the two-pass backward is deterministic already)")
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

    def smem_bytes_dkv(self, head_dim: int, itemsize: int = 2) -> int:
        k_and_v = 2 * NUM_CONSUMERS * self.block_kv_dkv * head_dim * itemsize
        ring = self.num_stages_dkv * (2 * self.block_q_dkv * head_dim * itemsize + 2 * self.block_q_dkv * 4)
        staging = 0
        if self.dq_atomic:  # both consumers' dS^T in one tile; two slots of dQ's float32 [block_q, D] in halves
            staging = (NUM_CONSUMERS * self.block_kv_dkv * self.block_q_dkv * itemsize
                       + 2 * self.block_q_dkv * head_dim * 4)
        return k_and_v + ring + staging + _HOPPER_SMEM_SLACK

    def smem_bytes_dq(self, head_dim: int, itemsize: int = 2) -> int:
        q_and_do = 2 * NUM_CONSUMERS * self.block_q_dq * head_dim * itemsize + 2 * NUM_CONSUMERS * self.block_q_dq * 4
        ring = self.num_stages_dq * 2 * self.block_kv_dq * head_dim * itemsize
        return q_and_do + ring + _HOPPER_SMEM_SLACK

    @classmethod
    def default(cls, head_dim: int, deterministic: bool = True, kv_len: int | None = None,
                is_causal: bool = False) -> "HopperBwdConfig":
        """Per padded head_dim (a multiple of 64), from the H100 tile sweep of 2026-11-23 (pallas_flash/kernels/
        NOTES.md, "Hopper backward"): 2-stage rings beat 3 for the plain (not overlapped) kernels (3-5% at
        head_dim 128, 1-2% at 64); 128-query Q/dO blocks in the dK/dV kernel only where head_dim 64 leaves the
        registers for them.
        head_dim 64: the one pass (dq_atomic), with its dQ adds ordered (dq_ordered, bitwise deterministic)
        unless deterministic=False; delta_in_dp throughout. On the H100 fwd+bwd 1.05-1.08x cuDNN free-order;
        ordered 1.04 / 1.05x non-causal and 1.03 / 1.02x causal at 8k / 16k keys (the full bar of session 16,
        2026-11-25; 0.99-1.00x causal without delta_in_dp), against the two passes' 0.93-1.03x. Except
        deterministic causal rows up to 2k keys (`kv_len`, `is_causal`: the call's): the two passes, 1.048x
        against the ordered one pass's 1.002x at 2k (equal at 4k), 1.085-1.088x with delta_in_dp (session 16).
        head_dim 128: the two passes either way
        (0.91-1.10x cuDNN; the one pass measured 0.82-0.91x free-order and 0.79-0.85x ordered), their dQ
        kernel pipelined (dq_overlap) over a 4-stage K/V ring: 1.01-1.13x at 2k keys and causal, 0.93-0.94x
        non-causal at 8k and 16k, against 0.92-1.11x without; and their dK/dV kernel (dkv_overlap, 4-stage Q/dO
        ring): non-causal 1.05 / 0.98 / 0.97x at 2k / 8k / 16k against 1.02 / 0.93 / 0.94x (session 9 of
        2026-11-24), and since the backward kernels take 240/24 registers (`hopper_bwd.REGISTERS`)
        1.10 / 1.03 / 1.03x against 1.05 / 0.98 / 0.97x with 232/40; causal 1.12 / 1.03 / 1.06x against the
        plain dK/dV kernel's 1.12-1.13 / 1.03-1.04 / 1.00-1.02x (session 10 of 2026-11-25; at 232/40 the
        causal dkv_overlap spilled 384 B and lost 2-8%); with delta_in_dp for causal rows up to 8k keys
        (`kv_len`, `is_causal`: the call's) 1.15 / 1.06x at 2k / 8k against 1.12 / 1.02x (session 16)."""
        if head_dim <= 64:
            ordered_pays = not (is_causal and kv_len is not None and kv_len <= 2048)
            one_pass = not deterministic or ordered_pays
            return cls(block_q_dkv=128, block_kv_dkv=64, num_stages_dkv=2, block_q_dq=64, block_kv_dq=128,
                       num_stages_dq=2, dq_atomic=one_pass, dq_ordered=deterministic and ordered_pays,
                       delta_in_dp=True)
        if head_dim <= 128:
            causal_up_to_8k = is_causal and kv_len is not None and kv_len <= 8192
            return cls(block_q_dkv=64, block_kv_dkv=64, num_stages_dkv=4, block_q_dq=64, block_kv_dq=64,
                       num_stages_dq=4, dq_overlap=True, dkv_overlap=True, delta_in_dp=causal_up_to_8k)
        # head_dim 256: K and V of 128 keys alone take 128 KiB of the dK/dV kernel's shared memory.
        raise ValueError(f"the Hopper backward takes head_dim <= 128, got {head_dim}")


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
            raise TypeError("KernelConfig.hopper_bwd must be a HopperBwdConfig or None, got "
                            f"{type(self.hopper_bwd).__name__}")
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
    def default(cls, head_dim: int, itemsize: int = 2, shared_memory_bytes: int = H100_SHARED_MEMORY,
                score_tile_bytes: int = 0) -> "KernelConfig":
        """The fastest variants measured on H100 for 2-byte inputs (pallas_flash/kernels/NOTES.md), shrunk
        until their pipelined tiles fit `shared_memory_bytes` at this `itemsize` (float32 doubles the tiles;
        smaller GPUs have less shared memory). `score_tile_bytes`: bytes per logit of the score-modifier
        tiles streamed beside K and V (a bias or mask spanning both queries and keys; 0 without)."""
        return _tuned(head_dim).fit_shared_memory(_padded_head_dim(head_dim), itemsize, shared_memory_bytes,
                                                  score_tile_bytes)

    def shared_memory(self, head_dim: int, itemsize: int, score_tile_bytes: int = 0) -> dict:
        """Estimated bytes of shared memory per kernel: num_stages copies of the tiles its loop streams
        (K and V in the forward and dQ kernels, Q and dO in the dK/dV kernel, and a [block_q, block_kv]
        bias/mask tile of `score_tile_bytes` per logit) plus the tiles it keeps resident (Q; K and V; Q and
        dO), which the matmuls may stage through shared memory too."""
        row = head_dim * itemsize
        return {"forward": (self.num_stages * 2 * self.block_kv + self.block_q) * row
                           + self.num_stages * self.block_q * self.block_kv * score_tile_bytes,
                "dkdv": (self.num_stages_dkv * 2 * self.block_q_dkv + 2 * self.block_kv_dkv) * row
                        + self.num_stages_dkv * self.block_q_dkv * self.block_kv_dkv * score_tile_bytes,
                "dq": (self.num_stages_dq * 2 * self.block_kv_dq + 2 * self.block_q_dq) * row
                      + self.num_stages_dq * self.block_q_dq * self.block_kv_dq * score_tile_bytes}

    def fit_shared_memory(self, head_dim: int, itemsize: int, budget: int,
                          score_tile_bytes: int = 0) -> "KernelConfig":
        """Fewer stages (down to 2), then smaller streamed blocks, then smaller resident blocks, until every
        kernel's estimate fits `budget`."""
        config = self
        shrinkable = {"forward": ("num_stages", "block_kv", "block_q"),
                      "dkdv": ("num_stages_dkv", "block_q_dkv", "block_kv_dkv"),
                      "dq": ("num_stages_dq", "block_kv_dq", "block_q_dq")}
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


def _padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _tuned(head_dim: int) -> KernelConfig:
    if head_dim <= 64:
        return KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3,
                            block_q_dkv=64, block_kv_dkv=64, num_warps_dkv=4, num_stages_dkv=3,
                            block_q_dq=64, block_kv_dq=64, num_warps_dq=4, num_stages_dq=3)
    if head_dim <= 128:
        return KernelConfig()
    # head_dim 256: smaller tiles so the accumulators fit in registers (not yet tuned on H100).
    return KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2,
                        block_q_dkv=32, block_kv_dkv=32, num_warps_dkv=4, num_stages_dkv=2,
                        block_q_dq=32, block_kv_dq=32, num_warps_dq=4, num_stages_dq=2)
