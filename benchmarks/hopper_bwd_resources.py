"""Compile one Hopper backward (`hopper_bwd.hopper_backward`) on the GPU and report what ptxas made of each
Mosaic GPU kernel: registers, spill stores/loads, and (with --ptx) how many wgmma instructions
(`wgmma.mma_async`) its PTX holds. Mosaic GPU prints these itself when MOSAIC_GPU_DUMP_PTXAS / MOSAIC_GPU_DUMP_PTX
are set (names read from jaxlib's CUDA plugin; they go to the process's stdout from C++, hence the child
process here).

    PYTHONPATH=. python benchmarks/hopper_bwd_resources.py --head-dim 128 --variant one-pass [--ptx]

Variants: two-pass (dK/dV and dQ kernels), two-pass-overlap (its dQ kernel pipelined: dq_overlap), one-pass
(dq_atomic), ordered (dq_atomic + dq_ordered).
Needs an sm90 GPU."""
import argparse
import dataclasses
import os
import re
import subprocess
import sys

VARIANTS = {  # HopperBwdConfig fields over the head_dim's default
    "two-pass": dict(dq_atomic=False, dq_ordered=False, dq_overlap=False, num_stages_dq=2),
    "two-pass-overlap": dict(dq_atomic=False, dq_ordered=False, dq_overlap=True, num_stages_dq=4),
    "one-pass": dict(dq_atomic=True, dq_ordered=False),
    "ordered": dict(dq_atomic=True, dq_ordered=True),
}


def compile_once(head_dim: int, variant: str, is_causal: bool) -> None:
    import jax
    import jax.numpy as jnp
    from pallas_flash.config import HopperBwdConfig
    from pallas_flash.kernels import hopper_bwd
    config = dataclasses.replace(HopperBwdConfig.default(head_dim), **VARIANTS[variant])
    x = jnp.zeros((1, 1024, 2, head_dim), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 1024), jnp.float32)
    jax.block_until_ready(hopper_bwd.hopper_backward(x, x, x, x, lse, x, None, scale=head_dim ** -0.5,
                                                     is_causal=is_causal, config=config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="one-pass")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--ptx", action="store_true", help="also count wgmma instructions in the PTX")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        compile_once(args.head_dim, args.variant, args.causal)
        return
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", **({"MOSAIC_GPU_DUMP_PTX": "1"} if args.ptx else {}))
    out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True,
                         text=True, check=True)
    text = out.stdout + out.stderr
    print(f"head_dim={args.head_dim} variant={args.variant} causal={args.causal}")
    for line in text.splitlines():
        if re.search(r"spill|Used \d+ registers|injected", line):
            print(" ", line.strip())
    if args.ptx:
        print("  wgmma.mma_async instructions in the PTX:", text.count("wgmma.mma_async"))


if __name__ == "__main__":
    main()
