"""pallas_flash: exact FlashAttention for JAX, as Pallas kernels."""
from pallas_flash.api import IMPLEMENTATIONS, STATIC_ARGNAMES, flash_attention
from pallas_flash.block_sparse import BlockMask
from pallas_flash.config import KernelConfig
from pallas_flash.reference import attention_reference

__all__ = ["flash_attention", "attention_reference", "BlockMask", "KernelConfig", "IMPLEMENTATIONS", "STATIC_ARGNAMES"]
__version__ = "0.1.0"
