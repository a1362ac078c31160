import jax
import pytest


def has_nvidia_gpu() -> bool:
    return jax.default_backend() == "gpu" and jax.devices()[0].device_kind.upper().startswith("NVIDIA")


def pytest_collection_modifyitems(config, items):
    if has_nvidia_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
