#!/usr/bin/env bash
# Reproduce results/ and the README's figures over seeds, from anywhere:
#   SEEDS="0 1 2" bash experiments/rl_async/run.sh [section.key=value ...]
# Per seed: one SFT, then the three variants from its weights (about 1 minute on 2 idle CPU cores at 2a13ce3), into
# results/seed_<n>/. async.seed=<n> sets the initial weights, the SFT batches, the worker's prompts and sampling
# keys, and the held-out prompts. Then results/summary.json (mean and min-max over seeds) and the plots.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Level 0 compiles about 3x faster on CPU; the numerics are unchanged.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
export PYTHONPATH=.
RESULTS=experiments/rl_async/results
for seed in ${SEEDS:-0 1 2}; do
  python experiments/rl_async/run.py --out "$RESULTS/seed_$seed" "$@" "async.seed=$seed"
done
python experiments/rl_async/aggregate.py "$RESULTS"
python experiments/rl_async/plots.py "$RESULTS"
