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
        and the next tile's Q, query ids and program row values load while this one runs) instead of one CTA
        per tile.
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

    def smem_bytes(self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0, head_dim_v: int | None = None) -> int:
        """Shared memory of the forward at this (padded) head_dim of query and key, `head_dim_v` of value and the
        output (None: head_dim) and input itemsize; `tile_bytes`: bytes per logit of the dense bias and mask tiles
        that ride the K/V ring (`dense_ring_bytes`), 0 without them."""
        head_dim_v = head_dim_v or head_dim
        own = self.separate_out(head_dim, itemsize, tile_bytes, head_dim_v)
        out_tile = self._q_tile_bytes(head_dim_v, itemsize) if own else 0
        return self._smem_bytes_sharing_q(head_dim, itemsize, tile_bytes, head_dim_v) + out_tile

    def separate_out(
        self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0, head_dim_v: int | None = None
    ) -> bool:
        """Whether the output tile gets its own shared memory (else it reuses Q's): always where value's head_dim
        is not query's (the tiles differ in shape); else for a persistent CTA, which then loads the next tile's Q
        while it stores this one's output, where it fits (not at head_dim 256)."""
        head_dim_v = head_dim_v or head_dim
        if head_dim_v != head_dim:
            return True
        with_out_tile = self._smem_bytes_sharing_q(head_dim, itemsize, tile_bytes) + self._q_tile_bytes(
            head_dim, itemsize
        )
        return self.persistent and with_out_tile <= H100_SHARED_MEMORY

    def fit(
        self, head_dim: int, itemsize: int, tile_bytes: int = 0, head_dim_v: int | None = None
    ) -> HopperConfig | None:
        """This config, or where its shared memory (with a dense bias/mask tile per stage of `tile_bytes` per
        logit, and value's `head_dim_v`) exceeds the H100's, the first of: fewer stages (down to 2), then halved
        key blocks (down to 64), that fits; None where none does. The query tile and the schedule flags stay."""
        config = self
        while config.smem_bytes(head_dim, itemsize, tile_bytes, head_dim_v) > H100_SHARED_MEMORY:
            if config.num_stages > 2:
                config = dataclasses.replace(config, num_stages=config.num_stages - 1)
            elif config.block_kv > 64:
                config = dataclasses.replace(config, block_kv=max(64, config.block_kv // 2 // 64 * 64))
            else:
                return None
        return config

    def _q_tile_bytes(self, head_dim: int, itemsize: int) -> int:
        return NUM_CONSUMERS * self.block_q * head_dim * itemsize

    def _smem_bytes_sharing_q(
        self, head_dim: int, itemsize: int, tile_bytes: int = 0, head_dim_v: int | None = None
    ) -> int:
        """Q (and the output in its place), the K/V ring with any dense tiles, the lse staging and the
        barriers."""
        kv_ring = self.num_stages * self.block_kv * (head_dim + (head_dim_v or head_dim)) * itemsize
        dense = dense_ring_bytes(self.num_stages, NUM_CONSUMERS * self.block_q, self.block_kv, tile_bytes)
        lse = NUM_CONSUMERS * self.block_q * 4
        return self._q_tile_bytes(head_dim, itemsize) + kv_ring + dense + lse + _SMEM_SLACK

    @classmethod
    def default(
        cls,
        head_dim: int,
        kv_len: int | None = None,
        is_causal: bool = False,
        sparse: bool = False,
        window: bool = False,
    ) -> HopperConfig:
        """The fastest tiles measured on the H100 per padded head_dim (docs/performance.md; the persistent
        thresholds at head_dim 64 and 128 on an H200, the H100's bar at 2k agreeing).

        head_dim 64: 256-key blocks (fewer, longer wgmmas per softmax), but 128 for causal rows up to 1k
        (mostly diagonal blocks); persistent CTAs for rows up to 4k and causal rows up to 8k (a CTA's fixed cost
        weighs on short rows: non-causal 2k 8% faster, 4k 3%; the folded order balances causal tiles), one CTA
        per tile elsewhere (non-causal 8k 2% slower persistent).
        head_dim 128: 128-key blocks, 2 stages (3 do not fit); rows up to 1k persistent unless causal; longer
        rows and a `window` of any span (`kv_len`; 256 to 1k keys 2-6% faster than on the short rows' tiles) the
        overlap, persistent for rows up to 4k (non-causal 2k 5% faster, 4k 2%, causal 4k 4%; a tie at
        8k, causal 16k 6% slower) and for `sparse` rows (segment ids, a mask program or a dense or block mask may
        leave a tile a few key blocks: 8 documents in 8k keys ran 9% faster persistent, 16 causal ones in 16k
        17%; a mask that hides nothing costs 0-1%, causal at 16k 6%). Wider heads: 64-key blocks (the only size
        that fits) and the overlap (S of block j on the tensor cores under block j-1's softmax: 9-11% faster at
        head_dim 256); up to head_dim 192 persistent for causal rows up to 8k (7-11% faster at 2k-8k, 4% slower
        at 16k; no gain at 256). Windows otherwise take the tiles of rows as long as their span."""
        known = kv_len is not None
        short = known and kv_len <= 1024
        if head_dim <= 64:
            if is_causal and short:
                return cls(block_q=64, block_kv=128, num_stages=3, persistent=True)
            persistent = known and (kv_len <= 4096 or (is_causal and kv_len <= 8192))
            return cls(block_q=64, block_kv=256, num_stages=2, persistent=persistent)
        if head_dim <= 128:
            if short and not window:
                return cls(block_q=64, block_kv=128, num_stages=2, persistent=not is_causal)
            persistent = (known and kv_len <= 4096) or sparse
            return cls(block_q=64, block_kv=128, num_stages=2, persistent=persistent, overlap=True)
        causal_8k = head_dim <= 192 and is_causal and known and kv_len <= 8192
        return cls(block_q=64, block_kv=64, num_stages=2, persistent=causal_8k, overlap=True)


def dense_ring_bytes(num_stages: int, rows: int, cols: int, tile_bytes: int) -> int:
    """Shared memory of a ring of dense bias/mask tiles ([rows, cols] per stage, `tile_bytes` per element
    over the arrays it carries) and their "ready" barriers (8 bytes per stage and array, at most 2 arrays)."""
    if not tile_bytes:
        return 0
    return num_stages * (rows * cols * tile_bytes + 2 * 8)


# the bool fields
_BWD_FLAGS = (
    "dq_atomic",
    "dq_ordered",
    "delta_in_dp",
    "dq_overlap",
    "dkv_overlap",
    "portable",
    "split_columns",
    "dq_split_products",
    "dkv_split_products",
)
# dK and dV of a consumer's 64 keys hold (head_dim + head_dim_v) / 2 float32 registers per thread: past this
# many they leave too few of the consumers' 240 for S^T, dP^T and P^T (`HopperBwdConfig.needs_split_columns`).
_MAX_ACCUMULATOR_REGISTERS = 160


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
      split_columns: the two passes' consumers share one block of rows (block_kv_dkv keys per dK/dV CTA,
        block_q_dq queries per dQ CTA) and each accumulates half of the head_dim columns of dK and dV (or dQ),
        recomputing the block's S and dP in full: half the resident tiles and accumulators, for head_dim 256
        (where two consumers' own tiles exceed shared memory and their accumulators the register file), at the
        price of the S and dP products done twice. Half of each head_dim must be whole 32-column tiles (192: 96
        each, under a 64-byte swizzle); not with dq_atomic.
      dq_split_products: with split_columns, the dQ pass's consumer 0 computes a block's S and P, consumer 1 its dP
        and dS from P passed through shared memory, and both add their columns of dQ from the shared dS tile: no
        product is done twice (3 tile products a step instead of 5). For calls without a score or mask program,
        dense tiles or dropout (the others run split_columns' way).
      dkv_split_products: with split_columns, the dK/dV pass's consumer 0 computes a block's S^T and P^T, consumer 1
        its dP^T and dS^T from P^T passed through shared memory (bf16, the precision dV's product reads it in), and
        both add their columns of dV and dK from the shared P^T and dS^T tiles: 4 tile products a step instead of 6.
        Same calls as dq_split_products; not with dkv_overlap.
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
    split_columns: bool = False
    dq_split_products: bool = False
    dkv_split_products: bool = False

    def __post_init__(self):
        for name in _BWD_FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HopperBwdConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dq_ordered and not self.dq_atomic:
            raise ValueError(
                "HopperBwdConfig.dq_ordered orders the one-pass backward's dQ reduce-adds: it needs "
                "dq_atomic=True (the two-pass backward is deterministic already)"
            )
        if self.dq_split_products and (not self.split_columns or self.dq_overlap):
            raise ValueError(
                "HopperBwdConfig.dq_split_products splits split_columns' dQ products: it needs split_columns=True "
                "and dq_overlap=False"
            )
        if self.dkv_split_products and (not self.split_columns or self.dkv_overlap):
            raise ValueError(
                "HopperBwdConfig.dkv_split_products splits split_columns' dK/dV products: it needs split_columns=True "
                "and dkv_overlap=False"
            )
        if self.split_columns and self.dq_atomic:
            raise ValueError("HopperBwdConfig.split_columns splits the two passes' accumulators: not with dq_atomic")
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

    @property
    def row_tiles(self) -> int:
        """Row tiles per CTA of the two passes (each consumer's own, or with split_columns one they share)."""
        return 1 if self.split_columns else NUM_CONSUMERS

    def smem_bytes_dkv(
        self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0, head_dim_v: int | None = None
    ) -> int:
        """Shared memory of the dK/dV kernel at query and key's (padded) head_dim and value's `head_dim_v` (None:
        head_dim); `tile_bytes`: bytes per logit of the dense bias and mask tiles that ride its Q/dO ring (0
        without them)."""
        both = head_dim + (head_dim_v or head_dim)
        keys = self.row_tiles * self.block_kv_dkv
        dense = dense_ring_bytes(self.num_stages_dkv, keys, self.block_q_dkv, tile_bytes)
        k_and_v = keys * both * itemsize
        ring = self.num_stages_dkv * (self.block_q_dkv * both * itemsize + 2 * self.block_q_dkv * 4)
        staging = 0
        if self.dq_atomic:  # both consumers' dS^T in one tile; two slots of dQ's float32 [block_q, D] in halves
            staging = (
                NUM_CONSUMERS * self.block_kv_dkv * self.block_q_dkv * itemsize + 2 * self.block_q_dkv * head_dim * 4
            )
        if self.dkv_split_products:  # a block's P^T and dS^T between the consumers
            staging += 2 * self.block_kv_dkv * self.block_q_dkv * itemsize
        return k_and_v + ring + staging + dense + _SMEM_SLACK

    def smem_bytes_dq(
        self, head_dim: int, itemsize: int = 2, tile_bytes: int = 0, dbias: bool = False, head_dim_v: int | None = None
    ) -> int:
        """Shared memory of the dQ kernel at query and key's (padded) head_dim and value's `head_dim_v` (None:
        head_dim); `tile_bytes`: bytes per logit of the dense bias and mask tiles that ride its K/V ring (0
        without them); `dbias`: with each consumer's float32 dS tile staged for dbias."""
        both = head_dim + (head_dim_v or head_dim)
        queries = self.row_tiles * self.block_q_dq
        q_and_do = queries * both * itemsize + 2 * NUM_CONSUMERS * self.block_q_dq * 4
        ring = self.num_stages_dq * self.block_kv_dq * both * itemsize
        dense = dense_ring_bytes(self.num_stages_dq, queries, self.block_kv_dq, tile_bytes)
        staging = self.row_tiles * self.block_q_dq * self.block_kv_dq * 4 if dbias else 0
        if self.dq_split_products:  # a block's float32 P and its dS between the consumers
            staging += self.block_q_dq * self.block_kv_dq * (4 + itemsize)
        return q_and_do + ring + dense + staging + _SMEM_SLACK

    def fit(
        self, head_dim: int, itemsize: int, tile_bytes: int = 0, dbias: bool = False, head_dim_v: int | None = None
    ) -> HopperBwdConfig | None:
        """The two passes at these tiles (the one pass takes no dense tiles), each pass whose shared memory (with
        a dense bias/mask tile per stage of `tile_bytes` per logit; `dbias`: the dQ kernel stages dS for dbias;
        value's `head_dim_v`) exceeds the H100's shrunk: to 2 stages (without its overlap, which wants 3), then
        halved streamed blocks (down to 64); None where that does not fit."""
        config = self
        if tile_bytes:
            config = dataclasses.replace(self, dq_atomic=False, dq_ordered=False)
        passes = (
            (lambda c: c.smem_bytes_dkv(head_dim, itemsize, tile_bytes, head_dim_v), "dkv", "block_q_dkv"),
            (lambda c: c.smem_bytes_dq(head_dim, itemsize, tile_bytes, dbias, head_dim_v), "dq", "block_kv_dq"),
        )
        for needed, name, block in passes:
            if needed(config) <= H100_SHARED_MEMORY:
                continue
            config = dataclasses.replace(config, **{f"num_stages_{name}": 2, f"{name}_overlap": False})
            while needed(config) > H100_SHARED_MEMORY:
                if getattr(config, block) == 64:
                    return None
                config = dataclasses.replace(config, **{block: max(64, getattr(config, block) // 2 // 64 * 64)})
        return config

    @staticmethod
    def needs_split_columns(head_dim: int, head_dim_v: int | None = None) -> bool:
        """Whether the two passes at these (padded) head dims need `split_columns`: a consumer's dK and dV of 64
        keys would take more than `_MAX_ACCUMULATOR_REGISTERS` float32 registers per thread."""
        return (head_dim + (head_dim_v or head_dim)) // 2 > _MAX_ACCUMULATOR_REGISTERS

    @staticmethod
    def can_split_columns(head_dim: int, head_dim_v: int | None = None) -> bool:
        """Whether half of each (padded) head_dim is whole 32-column tiles (`split_columns`: a 64-byte swizzle's
        tile of 16-bit elements, the narrowest wgmma's contraction takes)."""
        return all(d % (NUM_CONSUMERS * 32) == 0 for d in (head_dim, head_dim_v or head_dim))

    @classmethod
    def default(
        cls,
        head_dim: int,
        deterministic: bool = True,
        kv_len: int | None = None,
        is_causal: bool = False,
        head_dim_v: int | None = None,
    ) -> HopperBwdConfig:
        """The fastest variant measured on the H100 per padded head_dim (docs/performance.md); with value's
        `head_dim_v` (None: head_dim) that of the larger of the two.

        head_dim 64: the one pass (dq_atomic) with ordered dQ adds unless deterministic=False, delta_in_dp;
        deterministic causal rows up to 2k keys (`kv_len`, `is_causal`: the call's) take the two passes,
        faster there. head_dim 128: the two passes with both overlaps over 4-stage rings (the one pass lost
        9-18%), delta_in_dp for causal rows up to 8k keys (slower on longer and non-causal rows). Larger: the
        two passes over 64-row blocks and 2-stage rings (3 stages and the overlaps' extra operands do not fit
        beside the larger tiles), with `split_columns` where a consumer's dK and dV would not fit its registers
        (head_dim 256; `needs_split_columns`) and then both passes' split products (`dq_split_products`: backward
        2-5% faster at head_dim 256, 4k and 16k; `dkv_split_products` on top: fwd+bwd 8-11% faster); a ValueError
        where they need it but cannot be split."""
        widest = max(head_dim, head_dim_v or head_dim)
        if widest <= 64:
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
        if widest <= 128:
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
        split = cls.needs_split_columns(head_dim, head_dim_v)
        if split and not cls.can_split_columns(head_dim, head_dim_v):
            raise ValueError(
                f"the Hopper backward at head_dims {head_dim} (query, key) and {head_dim_v or head_dim} (value) "
                "needs split_columns, whose halves of each head_dim must be whole 32-column tiles"
            )
        return cls(split_columns=split, dq_split_products=split, dkv_split_products=split)
