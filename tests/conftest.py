import os

# JAX's Mosaic GPU interpreter (tests/test_attention.py) runs a CTA's warpgroups as threads whose barrier waits
# block inside host callbacks, each holding a thread of XLA's CPU thread pool. That pool has one thread per
# core unless NPROC says otherwise (read when the CPU client starts): on a 2-core machine the blocked waits and
# the interpreter's own callback can hold every pool thread while the warpgroup that would arrive waits for
# one, and the kernel hangs at random (segment-id calls: 4 hangs in 52 calls; none in 170 with NPROC=16;
# pallas_flash/kernels/NOTES.md). A kernel has at most 3 warpgroups blocked plus that callback: 8 threads
# leave room.
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 8)))

import jax
import pytest

# Float32 oracles (the dense reference, Flax's own attention, jax.nn) must multiply in float32: XLA's default
# on GPU rounds float32 matmul operands to tf32 (~1e-3 relative error), which would hide or fake a kernel error.
# The library itself asks for full precision explicitly wherever its inputs are float32.
jax.config.update("jax_default_matmul_precision", "highest")


def has_nvidia_gpu() -> bool:
    return jax.default_backend() == "gpu" and jax.devices()[0].device_kind.upper().startswith("NVIDIA")


def pytest_collection_modifyitems(config, items):
    if has_nvidia_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
