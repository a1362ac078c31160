import os

# JAX's Mosaic GPU interpreter (tests/hopper/test_interpreter.py) runs a CTA's warpgroups as threads whose barrier waits
# block inside host callbacks, each holding a thread of XLA's CPU thread pool. That pool has one thread per
# core unless NPROC says otherwise (read when the CPU client starts): on a 2-core machine the blocked waits and
# the interpreter's own callback can hold every pool thread while the warpgroup that would arrive waits for
# one, and the kernel hangs at random (segment-id calls: 4 hangs in 52 calls; none in 170 with NPROC=16). A
# kernel has at most 3 warpgroups blocked plus that callback: 8 threads leave room.
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 8)))
# Under pytest-xdist (the README's GPU command runs 8 workers on one GPU) each worker takes GPU memory as it needs
# it: by default each would reserve 75% of the GPU at its start, and the others would run out of memory.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


CPU_DEVICES = 8


def _fast_cpu_compile_flags() -> str:
    """XLA flags that make the CPU suite compile faster, or "" where they do not apply.

    Most of the CPU suite's time is XLA compiling small programs (Pallas interpret-mode kernels, tiny models),
    not running them. LLVM at -O0 compiles them in about 60% of the time; on jaxlib 0.10 the legacy CPU fusion
    emitters in about half the time of the MLIR ones (which jaxlib 0.12 made the only ones: there the flag is
    unknown, and an unknown flag aborts XLA, so it is set only on the version it was measured on). Neither
    changes what is computed (XLA CPU has no fast math by default); elementwise functions may round differently
    in the last bit, far inside every tolerance. Nothing is set where a CUDA plugin is installed (compiled GPU
    code stays optimised) or where XLA_FLAGS already names either flag."""
    from importlib import metadata

    dists = {(dist.metadata["Name"] or "").lower().replace("_", "-") for dist in metadata.distributions()}
    if any(name.startswith("jax-cuda") for name in dists):
        return ""
    set_by_user = os.environ.get("XLA_FLAGS", "")
    flags = []
    if "xla_backend_optimization_level" not in set_by_user:
        flags.append("--xla_backend_optimization_level=0")
    if "xla_cpu_use_fusion_emitters" not in set_by_user and metadata.version("jaxlib").startswith("0.10."):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    if "xla_force_host_platform_device_count" not in set_by_user:  # context parallelism over 2, 4, 8 CPU devices
        flags.append(f"--xla_force_host_platform_device_count={CPU_DEVICES}")
    return " ".join(flags)


os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_fast_cpu_compile_flags()}".strip()

import jax  # noqa: E402  (after NPROC and XLA_FLAGS, which JAX reads when its CPU client starts)
import pytest  # noqa: E402


def _keep_compiled_programs() -> None:
    """On the CPU, keep XLA's compiled programs between runs of the suite (JAX's persistent compilation cache,
    under the user's cache folder, one per JAX version): most of the suite's time is compiling, and on JAX 0.12 a
    second run takes under half the time of the first (on 0.10 about three quarters). JAX still traces and lowers
    every program, and a program's cache key is its HLO, compiler version and flags, so a hit is the executable a
    compile would give. Not on a GPU (the GPU tests read ptxas's notes, which a cached kernel never prints) nor
    where the user set JAX_COMPILATION_CACHE_DIR."""
    if jax.default_backend() != "cpu" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_home, "pallas_flash", f"jax-{jax.__version__}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_keep_compiled_programs()

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
