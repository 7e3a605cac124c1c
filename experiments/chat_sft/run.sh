#!/usr/bin/env bash
# Chat SFT on synthetic multi-turn tool-use conversations over seeds, from anywhere:
#   SEEDS="0 1 2" bash experiments/chat_sft/run.sh [section.key=value ...]
# Per seed <n>: training conversations generated with seed 2n, the model's initial weights and batch order from
# train.seed=n; the 200 held-out conversations are the same for every seed (seed 1, an odd seed no training set
# uses). Run directories go to $RUNS/seed_<n>/ (gitignored), the small result files to $RESULTS/seed_<n>/; then
# $RESULTS/summary.json (mean and min-max over seeds) and the plots. The three default seeds took 18 min 20 s on 2
# idle CPU cores at 2a13ce3 (about 6 minutes a seed). A smoke run of the machinery (16 minutes on the shared machine):
#   SEEDS="0 1" RESULTS=runs/chat_sft_smoke/results RUNS=runs/chat_sft_smoke TRAIN_RECORDS=40 HELDOUT_RECORDS=6 \
#     bash experiments/chat_sft/run.sh train.steps=2
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD"
EXP=experiments/chat_sft
RESULTS=${RESULTS:-$EXP/results}
RUNS=${RUNS:-runs/chat_sft}
mkdir -p "$RUNS"

# 200 held-out conversations (seed 1); ~26% of all conversations carry an erroneous assistant turn (a calculator
# call with the wrong operator, then a corrected call).
python "$EXP/synthetic_chat.py" "$RUNS/raw_heldout.jsonl" --num-records "${HELDOUT_RECORDS:-200}" --seed 1
python "$EXP/prepare_data.py" "$RUNS/raw_heldout.jsonl" "$RUNS/heldout.jsonl"

for seed in ${SEEDS:-0 1 2}; do
  DATA=$RUNS/seed_$seed
  OUT=$RESULTS/seed_$seed
  mkdir -p "$DATA" "$OUT"
  python "$EXP/synthetic_chat.py" "$DATA/raw_train.jsonl" --num-records "${TRAIN_RECORDS:-2000}" --seed $((2 * seed))
  python "$EXP/prepare_data.py" "$DATA/raw_train.jsonl" "$DATA/train.jsonl"
  python "$EXP/prepare_data.py" "$DATA/raw_train.jsonl" "$DATA/train_unmasked.jsonl" --unmask-errors
  # The SFT run (erroneous turns masked out of the loss) and the control (the same data with the error flags
  # removed, so the erroneous turns are trained), one after the other.
  python -m glm5_jax.cli train configs/sft_chat.yaml "train.seed=$seed" "train.run_dir=$DATA/masked" \
    "data.paths=[$DATA/train.jsonl]" "$@"
  python -m glm5_jax.cli train configs/sft_chat.yaml "train.seed=$seed" "train.run_dir=$DATA/unmasked" \
    "data.paths=[$DATA/train_unmasked.jsonl]" "$@"
  for run in masked unmasked; do
    python "$EXP/evaluate_sft.py" "$DATA/$run" "$RUNS/heldout.jsonl" "$OUT/${run}_eval.json"
    # Per-step training metrics, trimmed to the fields the README cites.
    python experiments/trim_metrics.py "$DATA/$run/metrics.jsonl" "$OUT/${run}_metrics.jsonl" \
      step loss lm_loss grad_norm lr tokens
  done
done
python "$EXP/aggregate.py" "$RESULTS"
python "$EXP/plots.py" "$RESULTS"
