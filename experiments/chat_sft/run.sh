#!/usr/bin/env bash
# Chat SFT on synthetic multi-turn tool-use conversations, from the repository root:
#   bash experiments/chat_sft/run.sh
# Run directories go to runs/chat_sft/ (gitignored); the small result files are copied to results/.
set -euo pipefail
export PYTHONPATH="$PWD"
EXP=experiments/chat_sft
DATA=runs/chat_sft
mkdir -p "$DATA" "$EXP/results"

# 2000 training conversations (seed 0) and 200 held-out ones (seed 1); ~26% carry an erroneous assistant turn
# (a calculator call with the wrong operator, then a corrected call).
python experiments/chat_sft/synthetic_chat.py "$DATA/raw_train.jsonl" --num-records 2000 --seed 0
python experiments/chat_sft/synthetic_chat.py "$DATA/raw_heldout.jsonl" --num-records 200 --seed 1
python "$EXP/prepare_data.py" "$DATA/raw_train.jsonl" "$DATA/train.jsonl"
python "$EXP/prepare_data.py" "$DATA/raw_train.jsonl" "$DATA/train_unmasked.jsonl" --unmask-errors
python "$EXP/prepare_data.py" "$DATA/raw_heldout.jsonl" "$DATA/heldout.jsonl"

# The SFT run (erroneous turns masked out of the loss) and the control (the same data with the error flags
# removed, so the erroneous turns are trained), side by side.
python -m glm5_jax.cli train configs/sft_chat.yaml train.run_dir="$DATA/masked" &
python -m glm5_jax.cli train configs/sft_chat.yaml train.run_dir="$DATA/unmasked" \
  "data.paths=[$DATA/train_unmasked.jsonl]"
wait

python "$EXP/evaluate_sft.py" "$DATA/masked" "$DATA/heldout.jsonl" "$EXP/results/masked_eval.json" &
python "$EXP/evaluate_sft.py" "$DATA/unmasked" "$DATA/heldout.jsonl" "$EXP/results/unmasked_eval.json"
wait
# Per-step training metrics, trimmed to the fields the README cites.
for run in masked unmasked; do
  python experiments/trim_metrics.py "$DATA/$run/metrics.jsonl" "$EXP/results/${run}_metrics.jsonl" step loss lm_loss grad_norm lr tokens
done
