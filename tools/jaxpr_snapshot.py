"""Normalised jaxprs of the forward and backward of every default configuration, one file per case, so a refactor
can be checked byte for byte.

    python -m tools.jaxpr_snapshot OUT_DIR [--seqs 384,4096,16384] [--families hopper,portable]
    (change the code)
    python -m tools.jaxpr_snapshot OUT_DIR2 ... && diff -r OUT_DIR OUT_DIR2

Each case is `jax.make_jaxpr` of `jax.value_and_grad` (in q, k, v) of sum(out) + sum(lse) of one family's entry
point (`flash_attention_hopper`, `flash_attention_portable`) with `KernelConfig.default(head_dim)`, bf16, GQA
(B=2, H=4, 2 key heads), traced on abstract inputs: nothing runs, so a CPU is enough. Cases: head_dim 64, 128,
256; causal or not; with segment ids or not; for Hopper, deterministic or not; at each of `--seqs` (the default
lengths reach every branch of `HopperConfig.default` and `HopperBwdConfig.default`: rows up to 1k, 2k, 8k and
longer). Source paths, line numbers and object addresses are removed. A case that raises is written as its
error. Prints each case's name, a hash of its text and its length.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re

BATCH, HEADS, KV_HEADS = 2, 4, 2
HEAD_DIMS = (64, 128, 256)


def normalise(text: str) -> str:
    text = re.sub(r"(/[\w.\-]+)+\.py:\d+(:\d+)?", "<src>", text)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def case_text(family: str, seq: int, head_dim: int, causal: bool, segments: bool, deterministic: bool) -> str:
    import jax
    import jax.numpy as jnp

    import pallas_flash as pf
    from pallas_flash import masks
    from pallas_flash.hopper.vjp import flash_attention_hopper
    from pallas_flash.portable.vjp import flash_attention_portable

    q = jax.ShapeDtypeStruct((BATCH, seq, HEADS, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((BATCH, seq, KV_HEADS, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((BATCH, seq), jnp.int32)
    band = masks.Band.of(causal, None)
    config = pf.KernelConfig.default(head_dim)

    def loss(q, k, v, q_ids, kv_ids):
        kw = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids) if segments else {}
        if family == "hopper":
            out, lse = flash_attention_hopper(
                q, k, v, scale=0.1, band=band, config=config, deterministic=deterministic, **kw
            )
        else:
            out, lse = flash_attention_portable(q, k, v, scale=0.1, band=band, config=config, interpret=False, **kw)
        return out.astype(jnp.float32).sum() + lse.sum()

    try:
        return normalise(str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, k, ids, ids)))
    except Exception as e:  # noqa: BLE001 - an unsupported case is part of the snapshot
        return f"ERROR {type(e).__name__}: {e}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.jaxpr_snapshot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", help="folder for one .txt per case")
    parser.add_argument("--seqs", default="384,4096,16384", help="sequence lengths (queries = keys)")
    parser.add_argument("--families", default="hopper,portable", help="comma list of hopper, portable")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    args = parser.parse_args(argv)
    families = args.families.split(",")
    if not set(families) <= {"hopper", "portable"}:
        parser.error(f"--families takes hopper, portable; got {args.families!r}")
    os.makedirs(args.out_dir, exist_ok=True)
    for family in families:
        for seq in (int(n) for n in args.seqs.split(",")):
            for head_dim in (int(d) for d in args.head_dims.split(",")):
                for causal in (False, True):
                    for segments in (False, True):
                        for deterministic in (True, False) if family == "hopper" else (True,):
                            name = (
                                f"{family}_n{seq}_d{head_dim}_{'causal' if causal else 'full'}_"
                                f"{'segments' if segments else 'plain'}{'' if deterministic else '_nondet'}"
                            )
                            text = case_text(family, seq, head_dim, causal, segments, deterministic)
                            with open(os.path.join(args.out_dir, name + ".txt"), "w") as f:
                                f.write(text)
                            print(name, hashlib.sha256(text.encode()).hexdigest()[:16], len(text), flush=True)


if __name__ == "__main__":
    main()
