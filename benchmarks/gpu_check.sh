#!/usr/bin/env bash
# GPU check of the Pallas DSA kernels on one H200 (or H100), under 9 minutes, no network, no grain.
# Run from the repository root:   PYTHONPATH=. bash benchmarks/gpu_check.sh
# Every result is a JSON line, printed and written to "${OUT:-/tmp}/gpu_check.jsonl".
set -uo pipefail

OUT_FILE="${OUT:-/tmp}/gpu_check.jsonl"
mkdir -p "$(dirname "$OUT_FILE")"
: > "$OUT_FILE"
export PYTHONPATH="${PYTHONPATH:-.}"
export PYTHONUNBUFFERED=1

# run_step SECONDS NAME COMMAND...: one benchmark under a hard time cap; a crash or a timeout becomes an
# error line, and the steps after it still run.
run_step() {
    local seconds="$1" name="$2"
    shift 2
    timeout --kill-after=10 "$seconds" "$@"
    local status=$?
    if [ "$status" -ne 0 ]; then
        echo "{\"check\": \"$name\", \"error\": \"exit status $status (124: stopped after ${seconds} s)\"}" \
            | tee -a "$OUT_FILE"
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# gpu: /'

# The caps below add up to 540 s, so the whole check ends within 9 minutes whatever hangs. Measured on an H200
# (2026-12-04, jax 0.11.2): the correctness pass takes ~85 s (mostly compiles), the tiny-model check 67 s, the 1B
# step 43 s of compile and 5 steps, each sweep candidate ~15 s.
# Kernels: every entry point against its jnp reference at GLM-5 head shapes (H 64, C 512, R 64, bf16; sparse
# MLA forward and backward, indexer scores with gradients and top-k, both KL targets, the Triton flash attention
# with its gradients), then forward / forward+backward time and TFLOP/s against cuDNN's flash attention (MLA's
# expanded form, 64 heads of 256) at S = 8K and 64K (N = 2048): the ends of the 8K..64K table of 2026-12-04, whose middle scaled as the ends say
# (sparse linearly, flash and the top-k quadratically), and 64K where DSA overtook flash (1.08x). No
# measurement starts after 165 s (on 2026-12-04: the correctness pass ~82 s, 8K ~20 s, the sparse kernels at 64K
# 45 s).
run_step 195 pallas_kernels python3 benchmarks/gpu_kernels.py --block-ns 64 --paths pallas_sparse,dense_flash,indexer_topk \
    --seqs 8192,65536 --budget-s 165 --out "$OUT_FILE"

# Where the top-k keeps every key (T <= 2048; the dense warm-up at any length) the model now runs jax's Triton flash
# attention instead of the sparse MLA kernels over every key (never timed on a GPU): the two at S = 2048 (top-k
# 2048 = every key), and the Triton flash against cuDNN's at 2K and 8K. The correctness pass above checked it.
run_step 50 flash_every_key python3 benchmarks/gpu_kernels.py --no-correctness --block-ns 64 \
    --paths pallas_flash,pallas_sparse,dense_flash --seqs 2048,8192 --budget-s 35 --out "$OUT_FILE"

# The tiny model's training steps (configs/tiny.yaml, bf16, Pallas DSA and grouped-matmul kernels) against the
# same steps on the host CPU: losses equal within bf16 tolerance at every step ("ok" in its summary line).
run_step 85 tiny_losses python3 benchmarks/gpu_tiny_losses.py --out "$OUT_FILE"

# Training step of a ~1B-parameter GLM-5-shaped model (bf16, S = 4096) with the Pallas DSA kernels: compile time
# (43 s on an H200's host), tokens/s and MFU against 989 TFLOP/s; it stops timing steps after --budget-s. (The jnp
# DSA path beside it, `--attention-backend pallas,sparse`, was timed on 2026-12-04: the kernels 1.34x faster.)
# Then two more steps under jax.profiler: each device timeline's busiest kernels and HLO ops ("step_profile" lines).
run_step 100 train_step python3 benchmarks/gpu_train_step.py --attention-backend pallas --budget-s 10 \
    --profile-steps 2 --out "$OUT_FILE"

# At S = 8192: the sparse MLA kernels as shipped (1 forward stage, 4 backward warps: 80.4 ms fwd+bwd before, on
# 2026-12-04) and with the backward that adds row gradients atomically (never timed); then the indexer score
# kernel's key block and warps, and the sparse KL target kernel's warps and stages.
run_step 110 kernel_sweep python3 benchmarks/gpu_kernel_sweep.py --candidates shipped,bwd_atomic_rows \
    --indexer-candidates scores_shipped,scores_keys_128_8_warps,scores_keys_256_8_warps \
    --target-candidates target_shipped,target_1_stage,target_4_warps --budget-s 85 --out "$OUT_FILE"

echo "# $(wc -l < "$OUT_FILE") JSON lines in $OUT_FILE"
