#!/usr/bin/env bash
# The trainer's flash-vs-dense results on one GPU (H100), in three parts that each fit a 10-minute call:
#   speed:  flash vs dense on the stdlib corpus at 4k context, same seed and data order: loss curves, tokens/s,
#           memory, and the longest context each trains at (doubling until out of memory, flash up to 262,144);
#           5-7 minutes;
#   agree:  the same run with seeds 1 and 2, no context search: GPU training is not bitwise reproducible, so
#           "the curves agree" is judged per seed against the spread between seeds (train/report.py,
#           seed_paired_verdict); about 2 x 1 minute;
#   recall: the associative-recall task (the `long` preset; train/data.py) trained at 1k and at 4k context on
#           the same tokens: validation loss, and accuracy on values whose key was last shown more than 1k
#           tokens back (a 1-in-16 guess without it); about 2 x 40 s, under a 240 s limit each.
#   context (two GPUs; not in `all`): the small preset at batch 1, tokens/s at 32k context on one GPU and on
#           `--mesh context=2` (zig-zag) in three interleaved pairs (runs differ by ~1% from process to process:
#           a ratio is a pair's, and the median of the pairs is reported), then the contiguous layout once;
#           about 5 minutes; its own summary (logs/summary.log), no report.
#   context_longest (two GPUs; not in `all`): the longest context one GPU and two train at (doubling from 256k;
#           one train step per context; a 2M step takes minutes); about 8 minutes.
# Usage: bash train/gpu_experiments.sh [OUT_DIR] [speed|agree|recall|all|context|context_longest]   (default: $OUT, else
#        runs/gpu_experiments/<date>, outside the source tree; all = speed, agree, recall in that order). The
#        summary is rebuilt from whatever parts OUT_DIR holds. Published results: train/results/.
# Writes OUT_DIR/results.{md,json}, agreement.png, long_range.png, small_both{,_seed1,_seed2}/{report.md,
# report.json,loss.png}, logs/.
set -uo pipefail
OUT_DIR="${1:-${OUT:-runs/gpu_experiments/$(date -u +%Y-%m-%d)}}"
PART="${2:-all}"
case "$PART" in
  speed|agree|recall|all|context|context_longest) ;;
  *) echo "part must be speed, agree, recall, all, context or context_longest, got '$PART'" >&2; exit 2;;
esac
mkdir -p "$OUT_DIR/logs"
# Let the longest-context search use most of the GPU instead of XLA's default 75% pool.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
COMMON=(--checkpoint_every 0 --progress false)

run() {  # run NAME TIME_LIMIT_S ARGS...: one training run, logged; a failure does not stop the others
  local name=$1 limit=$2
  shift 2
  echo "== $name: python -m train $*" | tee "$OUT_DIR/logs/$name.log"
  timeout "$limit" python -m train "$@" --run_dir "$OUT_DIR/$name" "${COMMON[@]}" 2>&1 | tee -a "$OUT_DIR/logs/$name.log"
  echo "== $name exit ${PIPESTATUS[0]}" | tee -a "$OUT_DIR/logs/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/logs/gpu.csv" 2>&1
if [[ $PART == context ]]; then
  AT_32K=(--preset small --batch_size 1 --seq_len 32768 --steps 100 --warmup_steps 1 --eval_every 0 --log_every 10
          --eval_tokens 32768)
  for pair in 1 2 3; do  # CUDA_VISIBLE_DEVICES=0: the one-GPU run sees device 0 only
    CUDA_VISIBLE_DEVICES=0 run "context_one_32k_$pair" 200 "${AT_32K[@]}"
    run "context_zigzag_32k_$pair" 200 "${AT_32K[@]}" --mesh context=2
  done
  run context_contiguous_32k 200 "${AT_32K[@]}" --mesh context=2 --context_layout contiguous
  grep -h "tokens/s" "$OUT_DIR"/logs/context_*.log | tee "$OUT_DIR/logs/summary.log"
  exit 0
fi
if [[ $PART == context_longest ]]; then
  LONGEST=(--preset small --batch_size 1 --seq_len 262144 --steps 1 --warmup_steps 0 --eval_every 0
           --eval_tokens 262144 --find_max_context true --max_context 4194304)
  CUDA_VISIBLE_DEVICES=0 run context_one_longest 600 "${LONGEST[@]}"
  run context_two_longest 900 "${LONGEST[@]}" --mesh context=2
  grep -h "context [0-9]*:" "$OUT_DIR"/logs/context_*.log | tee "$OUT_DIR/logs/summary.log"
  exit 0
fi
if [[ $PART == speed || $PART == all ]]; then
  run small_both 420 --preset small --attention both
fi
if [[ $PART == agree || $PART == all ]]; then
  # ~30 s compile + flash, ~25 s dense on the H100; speed's small_both is seed 0.
  for seed in 1 2; do
    run "small_both_seed$seed" 200 --preset small --attention both --max_context 0 --seed "$seed"
  done
fi
if [[ $PART == recall || $PART == all ]]; then
  run long_1k 240 --preset long --seq_len 1024 --batch_size 32
  run long_4k 240 --preset long --seq_len 4096 --batch_size 8
fi
python -m train.report "$OUT_DIR" 2>&1 | tee "$OUT_DIR/logs/summary.log"
