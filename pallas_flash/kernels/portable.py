"""Placeholder until the kernels land: routes to the chunked XLA path."""
from pallas_flash import xla_chunked


def flash_attention_portable(query, key, value, *, scale, is_causal, config, interpret):
    return xla_chunked.attention_chunked(query, key, value, scale=scale, is_causal=is_causal,
                                         block_kv=config.block_kv)
