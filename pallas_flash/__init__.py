"""pallas_flash: exact FlashAttention for JAX, as Pallas kernels."""

from pallas_flash.api import IMPLEMENTATIONS, STATIC_ARGNAMES, flash_attention
from pallas_flash.block_sparse import BlockMask
from pallas_flash.config import KernelConfig
from pallas_flash.decode import DECODE_IMPLEMENTATIONS, flash_decode, merge_attention_states
from pallas_flash.reference import attention_reference

__all__ = [
    "flash_attention",
    "flash_decode",
    "merge_attention_states",
    "attention_reference",
    "BlockMask",
    "KernelConfig",
    "IMPLEMENTATIONS",
    "DECODE_IMPLEMENTATIONS",
    "STATIC_ARGNAMES",
]
__version__ = "0.1.0"
