"""The few Pallas names that moved between the JAX versions we support (0.10.2 on CPU, 0.11+ on GPU)."""

from __future__ import annotations

import contextlib
import inspect

from jax.experimental import pallas as pl

try:  # JAX >= 0.10: an explicit marker for block dimensions squeezed out of the kernel's view.
    SQUEEZED = pl.squeezed
except AttributeError:  # older JAX spelled it None
    SQUEEZED = None

try:
    from jax.experimental.pallas import triton as _pl_triton

    TritonCompilerParams = _pl_triton.CompilerParams
except (ImportError, AttributeError):  # the Triton lowering may be removed from a future JAX
    TritonCompilerParams = None


def triton_params(num_warps: int, num_stages: int):
    """Compiler parameters for the Triton lowering, or None where it is not available."""
    if TritonCompilerParams is None:
        return None
    return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def smem_vector_load(ref, layout):
    """A whole Mosaic GPU shared-memory vector into registers in `layout`: JAX 0.10's `plgpu.load` takes the
    index as a second argument, 0.11 deprecates it (index the ref instead)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def mosaic_gpu_interpret_params(detect_races: bool = True):
    """Parameters that run a Mosaic GPU kernel in JAX's CPU interpreter (private in JAX 0.10-0.11), or None
    where this JAX has no such interpreter. On a machine with fewer than ~8 cores set the NPROC environment
    variable to 8 or more before JAX starts, or kernels may hang at random (tests/conftest.py says why)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams(detect_races=detect_races)


def mosaic_gpu_races_found() -> bool:
    """Whether the Mosaic GPU interpreter's race detection flagged a race in the last interpreted kernel."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return interpret_pallas_call.get_races().races_found


@contextlib.contextmanager
def mosaic_gpu_race_states():
    """Yields a list that collects the race-detection state of each Mosaic GPU kernel interpreted inside the
    block (`.races_found`), in order. The interpreter starts a fresh state per kernel, so after a function
    that runs several kernels `mosaic_gpu_races_found` speaks for the last one only."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    # JAX 0.12 renamed the class (RaceDetectionState -> GPURaceDetectionState).
    name = "GPURaceDetectionState" if hasattr(gpu_callbacks, "GPURaceDetectionState") else "RaceDetectionState"
    states = []
    original = getattr(gpu_callbacks, name)

    def record(*args, **kwargs):
        states.append(original(*args, **kwargs))
        return states[-1]

    setattr(gpu_callbacks, name, record)
    try:
        yield states
    finally:
        setattr(gpu_callbacks, name, original)


def semaphore_wait_at_least(semaphore, value):
    """Blocks the calling Mosaic GPU warpgroup until the global semaphore `semaphore` (a scalar ref of
    `pl.get_global(plgpu.SemaphoreType.REGULAR(...))`) holds at least `value`, without decrementing it, with
    GPU-scope acquire ordering (one thread polls, then a warpgroup barrier). JAX 0.10.2's
    `plgpu.semaphore_wait(sem, value, decrement=False, memory_scope="gpu")`; `pl.semaphore_wait` (no
    memory_scope, system scope) where this JAX's Mosaic GPU API lacks those keywords."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wait = getattr(plgpu, "semaphore_wait", None)
    if wait is not None:
        params = inspect.signature(wait).parameters
        if "decrement" in params and "memory_scope" in params:
            return wait(semaphore, value, decrement=False, memory_scope="gpu")
    return pl.semaphore_wait(semaphore, value, decrement=False)


def semaphore_signal_gpu(semaphore, inc: int = 1):
    """Adds `inc` to a global semaphore from one thread of the calling warpgroup, with GPU-scope release
    ordering (`red.release.gpu.global.add`) after a warpgroup barrier: JAX 0.10.2's
    `plgpu.semaphore_signal(sem, inc, memory_scope="gpu")`; `pl.semaphore_signal` (system scope) otherwise."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    signal = getattr(plgpu, "semaphore_signal", None)
    if signal is not None and "memory_scope" in inspect.signature(signal).parameters:
        return signal(semaphore, inc, memory_scope="gpu")
    return pl.semaphore_signal(semaphore, inc)


def lowering_gpu(device_kind: str = "NVIDIA H100 80GB HBM3"):
    """A context in which Pallas's Triton lowering targets `device_kind` without a GPU present (ahead-of-time
    lowering for CUDA on a CPU machine). JAX 0.12 reads the target from the abstract mesh's device; older
    versions need nothing."""
    import jax

    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None or "abstract_device" not in inspect.signature(jax.sharding.AbstractMesh).parameters:
        return contextlib.nullcontext()
    device = abstract_device(device_kind=device_kind, num_cores=None, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("lowering",), abstract_device=device))
