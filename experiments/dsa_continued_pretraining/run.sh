#!/usr/bin/env bash
# DSA continued pre-training in miniature over seeds, from anywhere:
#   SEEDS="0 1 2" bash experiments/dsa_continued_pretraining/run.sh
# train.seed=<n> sets the initial weights of the dense pre-training and the batch order of every stage (and of
# the validation batches, the same for every stage of one seed). Run directories go to runs/dsa/seed_<n>/
# (gitignored); the small result files to results/seed_<n>/; then results/summary.json (mean and min-max over
# seeds) and the plots. The three seeds took 10 min 41 s on 2 idle CPU cores at 2a13ce3.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD"
EXP=experiments/dsa_continued_pretraining

for seed in ${SEEDS:-0 1 2}; do
  RUNS=runs/dsa/seed_$seed
  OUT=$EXP/results/seed_$seed
  mkdir -p "$RUNS" "$OUT"
  # 1. Dense-MLA pre-training at seq_len 512 (index_topk 512 = every causal key). The recipe's cosine spans 160
  #    steps; the experiment stops at step 80 (its checkpoint) to fit the CPU budget.
  python -m glm5_jax.cli train configs/pretrain_dense_long.yaml train.steps=80 "train.seed=$seed" \
    "train.run_dir=$RUNS/dense_pretrain"
  # 2. Dense warm-up: indexer only, KL to the main attention, LR 5e-3 -> 2e-4, 30 steps.
  python -m glm5_jax.cli train configs/dsa_warmup.yaml "train.seed=$seed" "train.init_from=$RUNS/dense_pretrain" \
    "train.run_dir=$RUNS/warmup"
  # 3. Sparse adaptation (top-64 of 512 keys, all parameters, constant LR 3e-4) and its dense control (the
  #    pre-trained model continued densely, same steps, batches and LR), one after the other.
  python -m glm5_jax.cli train configs/dsa_sparse.yaml "train.seed=$seed" "train.init_from=$RUNS/warmup" \
    "train.run_dir=$RUNS/sparse"
  python -m glm5_jax.cli train "$EXP/dense_control.yaml" "train.seed=$seed" "train.init_from=$RUNS/dense_pretrain" \
    "train.run_dir=$RUNS/dense_control"
  # 4. Held-out loss of every stage on the same validation batches, curve summaries, attention FLOPs.
  python "$EXP/evaluate_dsa.py" "$OUT/summary.json" \
    "dense_pretrain_dense=$RUNS/dense_pretrain@512" \
    "dense_pretrain_top64_untrained_indexer=$RUNS/dense_pretrain@64" \
    "after_warmup_top64=$RUNS/warmup@64" \
    "dsa_sparse_top64=$RUNS/sparse@64" \
    "dense_control_dense=$RUNS/dense_control@512" \
    "dense_control_top64_untrained_indexer=$RUNS/dense_control@64"
  # Per-step training metrics, trimmed to the fields the README cites.
  for run in dense_pretrain warmup sparse dense_control; do
    python experiments/trim_metrics.py "$RUNS/$run/metrics.jsonl" "$OUT/${run}_metrics.jsonl" \
      step loss lm_loss indexer_kl topk_attention_mass grad_norm lr tokens
  done
done
python "$EXP/aggregate.py" "$EXP/results"
python "$EXP/plots.py" "$EXP/results"
