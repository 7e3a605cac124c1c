#!/usr/bin/env bash
# DSA continued pre-training in miniature, from the repository root:
#   bash experiments/dsa_continued_pretraining/run.sh
# Run directories go to runs/dsa/ (gitignored); the small result files are copied to results/.
set -euo pipefail
export PYTHONPATH="$PWD"
EXP=experiments/dsa_continued_pretraining
mkdir -p runs/dsa "$EXP/results"

# 1. Dense-MLA pre-training at seq_len 512 (index_topk 512 = every causal key). The recipe's cosine spans 160
#    steps; the experiment stops at step 80 (its checkpoint) to fit the CPU budget.
python -m glm5_jax.cli train configs/pretrain_dense_long.yaml train.steps=80
# 2. Dense warm-up: indexer only, KL to the main attention, LR 5e-3 -> 2e-4, 30 steps.
python -m glm5_jax.cli train configs/dsa_warmup.yaml
# 3. Sparse adaptation (top-64 of 512 keys, all parameters, constant LR 3e-4) and its dense control
#    (the pre-trained model continued densely, same steps, batches and LR), side by side.
python -m glm5_jax.cli train configs/dsa_sparse.yaml &
python -m glm5_jax.cli train "$EXP/dense_control.yaml"
wait
# 4. Held-out loss of every stage on the same validation batches, curve summaries, attention FLOPs.
python "$EXP/evaluate_dsa.py" "$EXP/results/summary.json" \
  dense_pretrain_dense=runs/dsa/dense_pretrain@512 \
  dense_pretrain_top64_untrained_indexer=runs/dsa/dense_pretrain@64 \
  after_warmup_top64=runs/dsa/warmup@64 \
  dsa_sparse_top64=runs/dsa/sparse@64 \
  dense_control_dense=runs/dsa/dense_control@512 \
  dense_control_top64_untrained_indexer=runs/dsa/dense_control@64
# Per-step training metrics, trimmed to the fields the README cites.
for run in dense_pretrain warmup sparse dense_control; do
  python experiments/trim_metrics.py "runs/dsa/$run/metrics.jsonl" "$EXP/results/${run}_metrics.jsonl" step loss lm_loss indexer_kl topk_attention_mass grad_norm lr tokens
done
