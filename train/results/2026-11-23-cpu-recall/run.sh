#!/usr/bin/env bash
# The CPU recall comparison recorded here: the same model, steps and tokens per step (4,096), trained at
# context 128 (batch 32) and 512 (batch 8) on 512-token recall documents, from the repository root:
#   bash train/results/2026-11-23-cpu-recall/run.sh
set -uo pipefail
OUT=train/results/2026-11-23-cpu-recall
RECALL=(--preset tiny --data recall --recall_doc_len 512 --recall_num_keys 4 --recall_values_per_key 16
        --recall_fact_probability 0.125 --recall_far_distance 128 --steps 1000 --warmup_steps 30
        --learning_rate 3e-3 --eval_every 250 --eval_tokens 65536 --attention flash --checkpoint_every 0
        --progress false)
for run in "512 8" "128 32"; do
  set -- $run
  echo "== python -m train ${RECALL[*]} --seq_len $1 --batch_size $2 --run_dir $OUT/ctx$1" | tee "$OUT/ctx$1.log"
  python -m train "${RECALL[@]}" --seq_len "$1" --batch_size "$2" --run_dir "$OUT/ctx$1" 2>&1 | tee -a "$OUT/ctx$1.log"
done
