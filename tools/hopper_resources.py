"""Compile one Hopper backward (`pallas_flash.hopper.bwd.hopper_backward`), or with --forward one forward with a
flex case's modifier, on the GPU and report what ptxas made of each Mosaic GPU kernel: registers, spill
stores/loads, and (with --ptx) how many wgmma instructions (`wgmma.mma_async`) its PTX holds. Mosaic GPU prints
these itself when MOSAIC_GPU_DUMP_PTXAS / MOSAIC_GPU_DUMP_PTX are set (names read from jaxlib's CUDA plugin; they go
to the process's stdout from C++, hence the child process).

    python -m tools.hopper_resources --head-dim 128 --variant one-pass [--causal] [--ptx] [--sass DIR]
        [--registers 240,24] [--set delta_in_dp=1]
    python -m tools.hopper_resources --forward bias_table [--head-dim 128] [--seq 8192] [--ptx] [--sass DIR]

Backward variants: two-pass (dK/dV and dQ kernels), two-pass-overlap (its dQ kernel pipelined: dq_overlap),
two-pass-both-overlap (both kernels pipelined: dq_overlap, dkv_overlap), one-pass (dq_atomic), ordered
(dq_atomic + dq_ordered). `--set`: HopperBwdConfig fields over the variant's (one item of the bar suite's --bwd).
`--registers`: setmaxnreg budgets (consumer, producer) of the backward kernels instead of
`pallas_flash.hopper.common.REGISTERS`.
--forward CASE: `flash_attention`'s forward on the Hopper kernels with the flex suite's case CASE
(`benchmarks.flex.cases`: soft_cap_causal, alibi, bias_table, document, ...; or plain / plain_causal), at its
shapes (B*N = 16k tokens, H=16, --head-dim, N = --seq) and default tiles: what a modifier costs in registers and
instructions beside the plain kernel. --variant, --set and --registers are the backward's.
--sass DIR: the kernels' SASS, for what ptxas's counts do not say (which values spill, which waits and fences a step
holds): the PTX Mosaic GPU dumps to DIR is assembled with the CUDA toolkit's ptxas (-arch=sm_90a -O3) and
disassembled with cuobjdump (both from /usr/local/cuda/bin or PATH); per kernel DIR gets .ptx, .cubin and .sass,
and a summary of its instruction counts is printed. Needs an sm90 GPU.
"""

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

VARIANTS = {  # HopperBwdConfig fields over the head_dim's default
    "two-pass": dict(
        dq_atomic=False, dq_ordered=False, dq_overlap=False, num_stages_dq=2, dkv_overlap=False, num_stages_dkv=2
    ),
    "two-pass-overlap": dict(
        dq_atomic=False, dq_ordered=False, dq_overlap=True, num_stages_dq=4, dkv_overlap=False, num_stages_dkv=2
    ),
    "two-pass-both-overlap": dict(
        dq_atomic=False, dq_ordered=False, dq_overlap=True, num_stages_dq=4, dkv_overlap=True, num_stages_dkv=4
    ),
    "one-pass": dict(dq_atomic=True, dq_ordered=False, num_stages_dkv=2),
    "ordered": dict(dq_atomic=True, dq_ordered=True, num_stages_dkv=2),
}


def compile_once(head_dim: int, variant: str, is_causal: bool, registers: str | None, overrides: str | None) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.bar import parse_bwd_overrides
    from pallas_flash.hopper import bwd, bwd_dkdv, bwd_dq
    from pallas_flash.hopper.config import HopperBwdConfig

    if registers:  # read when a kernel is traced, from each kernel module's own name
        bwd_dkdv.REGISTERS = bwd_dq.REGISTERS = tuple(int(x) for x in registers.split(","))
    extra = parse_bwd_overrides(overrides)[0] or {}
    config = dataclasses.replace(HopperBwdConfig.default(head_dim), **{**VARIANTS[variant], **extra})
    x = jnp.zeros((1, 1024, 2, head_dim), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 1024), jnp.float32)
    jax.block_until_ready(
        bwd.hopper_backward(x, x, x, x, lse, x, None, scale=head_dim**-0.5, is_causal=is_causal, config=config)
    )


PLAIN = {"plain": False, "plain_causal": True}  # --forward's cases without a modifier: is_causal


def forward_cases() -> list[str]:
    from benchmarks import flex

    return [*PLAIN, *(case.name for case in flex.cases(window=1024))]


def compile_forward(name: str, head_dim: int, seq: int) -> None:
    """The forward of `flash_attention` on the Mosaic GPU kernels with flex case `name` (or a plain call)."""
    import jax
    import jax.numpy as jnp

    import pallas_flash as pf
    from benchmarks import flex
    from benchmarks.inputs import Point

    if name in PLAIN:
        kwargs_of, arrays_of, causal = (lambda a: dict(is_causal=PLAIN[name])), (lambda p: {}), PLAIN[name]
    else:
        case = {c.name: c for c in flex.cases(window=1024)}[name]
        kwargs_of, arrays_of, causal, seq = case.mod, case.arrays, case.causal, seq * case.seq_factor
    sizes = flex.Sizes()
    batch = max(1, sizes.tokens // seq)
    point = Point("resources", batch, seq, seq, sizes.heads, sizes.heads, head_dim, causal, "bfloat16")
    arrays = {k: jnp.asarray(v) for k, v in arrays_of(point).items()}
    x = jnp.zeros((batch, seq, sizes.heads, head_dim), jnp.bfloat16)
    call = lambda q, a: pf.flash_attention(q, q, q, implementation="mosaic", **kwargs_of(a))  # noqa: E731
    jax.block_until_ready(jax.jit(call)(x, arrays))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.hopper_resources",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="one-pass")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--ptx", action="store_true", help="also count wgmma instructions in the PTX")
    parser.add_argument("--sass", metavar="DIR", help="dump PTX to DIR, assemble and disassemble it to SASS there")
    parser.add_argument(
        "--registers", metavar="CONSUMER,PRODUCER", help="setmaxnreg budgets of the backward kernels instead of theirs"
    )
    parser.add_argument(
        "--set",
        metavar="FIELD=INT,...",
        help="HopperBwdConfig fields over the variant's (one item of the bar suite's --bwd)",
    )
    parser.add_argument("--forward", metavar="CASE", help="a forward with this flex case instead (see above)")
    parser.add_argument("--seq", type=int, default=8192, help="--forward's sequence length (default 8192)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.forward is not None and args.forward not in (known := forward_cases()):
        parser.error(f"--forward takes one of {', '.join(known)}, got {args.forward!r}")
    if args.child:
        if args.forward:
            compile_forward(args.forward, args.head_dim, args.seq)
        else:
            compile_once(args.head_dim, args.variant, args.causal, args.registers, args.set)
        return
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", **({"MOSAIC_GPU_DUMP_PTX": "1"} if args.ptx else {}))
    dump = tempfile.mkdtemp() if args.sass else None  # Mosaic GPU dumps every pass's IR there too (~40 MB)
    if dump:
        env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=dump)
    out = subprocess.run(
        [sys.executable, "-m", "tools.hopper_resources", "--child", *argv],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    text = out.stdout + out.stderr
    what = f"forward={args.forward} seq={args.seq}" if args.forward else f"variant={args.variant} causal={args.causal}"
    print(
        f"head_dim={args.head_dim} {what}"
        + (f" registers={args.registers}" if args.registers else "")
        + (f" set={args.set}" if args.set else "")
    )
    for line in text.splitlines():
        if re.search(r"spill|Used \d+ registers|injected", line):
            print(" ", line.strip())
    if args.ptx:
        print("  wgmma.mma_async instructions in the PTX:", text.count("wgmma.mma_async"))
    if dump:
        os.makedirs(args.sass, exist_ok=True)
        for name in sorted(os.listdir(dump)):
            if name.endswith((".ptx", ".ptxas")):
                shutil.copy(os.path.join(dump, name), args.sass)
        shutil.rmtree(dump)
        summarize_sass(args.sass)


# SASS opcodes worth counting per kernel: tensor-core instructions and their waits, spills, and the fences and
# named barriers that shared-memory stores for a TMA or a wgmma operand bring (`plgpu.commit_smem`).
SASS_OPCODES = (
    "HGMMA",
    "WARPGROUP.DEPBAR",
    "WARPGROUP.ARRIVE",
    "STL",
    "LDL",
    "MEMBAR",
    "BAR.SYNC",
    "SYNCS.PHASECHK",
    "UBLKRED",
    "UTMAREDG",
    "UTMASTG",
    "UTMALDG",
)


def summarize_sass(directory: str) -> None:
    tools = [os.path.join("/usr/local/cuda/bin", name) for name in ("ptxas", "cuobjdump")]
    ptxas, cuobjdump = (tool if os.path.exists(tool) else os.path.basename(tool) for tool in tools)
    for ptx in sorted(f for f in os.listdir(directory) if f.endswith(".ptx")):
        stem = os.path.join(directory, ptx[: -len(".ptx")])
        subprocess.run([ptxas, "-arch=sm_90a", "-O3", f"{stem}.ptx", "-o", f"{stem}.cubin"], check=True)
        sass = subprocess.run([cuobjdump, "-sass", f"{stem}.cubin"], check=True, capture_output=True, text=True).stdout
        with open(f"{stem}.sass", "w") as f:
            f.write(sass)
        opcodes = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.MULTILINE)
        counts = {name: sum(op.startswith(name) for op in opcodes) for name in SASS_OPCODES}
        print(
            f"  {os.path.basename(stem)}: {len(opcodes)} instructions;",
            ", ".join(f"{name} {n}" for name, n in counts.items() if n),
        )


if __name__ == "__main__":
    main()
