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
