"""What this process runs on: the one place that asks JAX about the device."""

from __future__ import annotations

import jax

from pallas_flash.hopper.config import H100_SHARED_MEMORY


def on_nvidia_gpu() -> bool:
    return jax.default_backend() == "gpu" and jax.devices()[0].device_kind.upper().startswith("NVIDIA")


def on_hopper_gpu() -> bool:
    """An sm90 GPU: the Mosaic GPU kernels use its wgmma and TMA instructions."""
    return jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def shared_memory_bytes() -> int:
    """Shared memory a block may use on this GPU: 227 KiB on Hopper, 163 KiB on A100, 99 KiB on other
    recent parts (CUDA's per-block opt-in limits). Without a GPU (interpret mode) it does not matter."""
    if not on_nvidia_gpu():
        return H100_SHARED_MEMORY
    major, minor = (int(x) for x in str(getattr(jax.devices()[0], "compute_capability", "9.0")).split(".")[:2])
    if major >= 9:
        return H100_SHARED_MEMORY
    return 163 * 1024 if (major, minor) in ((8, 0), (8, 7)) else 99 * 1024
