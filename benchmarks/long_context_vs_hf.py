"""Long-context training step: glm5_jax in `dsa_sparse` mode against Hugging Face `GlmMoeDsaForCausalLM`.

The `small` config of train_step_vs_hf.py with `index_topk` 256, batch 1, fp32, MTP off, at sequence lengths
2K ... 32K. Both sides get the same weights (glm5_jax's init, exported to HF through `glm5_jax.convert.hf`)
and the same token batches (numpy, from --seed).
  glm5_jax  the jitted `make_train_step` in mode `dsa_sparse` (top-k attention on the `sparse` backend, LM loss,
            indexer KL over the selected set, AdamW, clip 1.0), per-layer remat `full` by default
            (--remat-policy), the indexer and the sparse attention run 1024 queries at a time
            (--index-query-chunk); the first step compiles and is not timed.
  HF        model.train(), loss.backward(), clip_grad_norm_(1.0), torch.optim.AdamW.step(); the first step
            is a warm-up. HF computes every [S, T] score and masks it to the top-k.
Each (side, length) runs in its own child process capped at --mem-cap-gib of address space (RLIMIT_AS; see
benchmarks/capped_child.py), which reports its peak RSS (getrusage ru_maxrss); a side that needs more fails
inside the child and is recorded as "does_not_fit" at the cap. Once a side does not fit at a length, longer
lengths are recorded as not run for that side (they need more).

One JSON line per length with both sides' tokens/s (median of the timed steps), ms per token, peak RSS, first
losses (the same weights and tokens give the same first loss) and the ratios; then a summary line with the
first length at which HF does not fit, the growth of time per token from the shortest to the longest length
per side, and the issue-17 targets.

  PYTHONPATH=. python benchmarks/long_context_vs_hf.py [--seqs 2048 4096 8192 16384 32768] [--mem-cap-gib 20]
(default lengths 2048 4096, two timed steps each: 5 minutes on 2 idle CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from benchmarks.capped_child import GIB, run_capped
from benchmarks.hf_reference import HF_ATTENTION, adamw_train_runner, load_model

SEQS = (2048, 4096, 8192, 16384, 32768)  # the lengths: --seqs 2048 4096 8192 16384 32768
# The default run stays under 10 minutes on 2 CPU cores; 16K and 32K are minutes per glm5_jax step there.
DEFAULT_SEQS = (2048, 4096)
INDEX_TOPK = 256
TRAIN_MODES = ("dsa_sparse", "pretrain")
REMAT_POLICIES = ("none", "dots", "dots_no_batch", "full")
THIS = "benchmarks.long_context_vs_hf"


def token_batches(vocab_size: int, seq: int, count: int, seed: int) -> list[np.ndarray]:
    """The batches both sides train on, rebuilt identically in each child."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, (1, seq), dtype=np.int32) for _ in range(count)]


def model_config(seq: int, index_query_chunk: int, remat_policy: str):
    import dataclasses

    from benchmarks.train_step_vs_hf import CONFIGS

    return dataclasses.replace(CONFIGS["small"], index_topk=INDEX_TOPK, attention_backend="sparse",
                               max_position_embeddings=max(seq, 4096), index_query_chunk=index_query_chunk,
                               remat_policy=remat_policy)


def optim_dict() -> dict:
    from benchmarks.train_step_vs_hf import OPTIM

    return {k: getattr(OPTIM, k) for k in ("lr", "b1", "b2", "eps", "weight_decay", "grad_clip_norm")}


def timed_steps(run, batches: list[np.ndarray], warmup: int) -> tuple[list[float], float, float]:
    """(times of the steps after `warmup`, first step's seconds, first loss)."""
    times, first_s, first_loss = [], 0.0, float("nan")
    for i, tokens in enumerate(batches):
        start = time.perf_counter()
        loss = run(tokens)
        elapsed = time.perf_counter() - start
        if i == 0:
            first_s, first_loss = elapsed, loss
        if i >= warmup:
            times.append(elapsed)
    return times, first_s, first_loss


def summarise(times: list[float], first_s: float, first_loss: float, seq: int) -> dict:
    step = statistics.median(times)
    return {"tokens_per_s": round(seq / step, 1), "step_s": round(step, 3), "ms_per_token": round(1e3 * step / seq, 4),
            "timed_steps": len(times), "first_step_s": round(first_s, 2), "first_loss": round(first_loss, 5)}


def jax_child(spec: dict) -> dict:
    """One glm5_jax measurement (runs in a capped child)."""
    import jax

    from benchmarks.train_step_vs_hf import OPTIM, lm_batch
    from glm5_jax.config import TrainConfig
    from glm5_jax.model.transformer import init
    from glm5_jax.train.optim import make_optimizer
    from glm5_jax.train.step import init_train_state, make_train_step

    seq = spec["seq"]
    config = model_config(seq, spec["index_query_chunk"], spec["remat_policy"])
    params = init(config, jax.random.key(spec["seed"]))
    optimizer = make_optimizer(OPTIM, params, config=config)
    step = make_train_step(config, TrainConfig(mode=spec["mode"], batch_size=1, seq_len=seq), optimizer)
    state = {"s": init_train_state(params, optimizer)}
    del params

    def run(tokens):
        state["s"], metrics = step(state["s"], lm_batch(tokens))
        return float(jax.block_until_ready(metrics["lm_loss"]))

    batches = token_batches(config.vocab_size, seq, 1 + spec["steps"], spec["seed"] + 1)
    result = summarise(*timed_steps(run, batches, 1), seq)
    result["compile_and_first_step_s"] = result.pop("first_step_s")
    return result


def hf_child(spec: dict) -> dict:
    """One HF measurement (runs in a capped child; imports no jax)."""
    model = load_model(spec["weights_dir"], spec["hf_attention"], spec["threads"])
    run = adamw_train_runner(model, spec["optim"])
    batches = token_batches(model.config.vocab_size, spec["seq"], 1 + spec["steps"], spec["seed"] + 1)
    return summarise(*timed_steps(run, batches, 1), spec["seq"])


def export_hf_weights(seed: int, directory: str) -> None:
    """glm5_jax's initial parameters (same seed as the jax child) in HF form, written by a child process so
    this parent stays small."""
    import jax

    from benchmarks.hf_reference import export_weights
    from glm5_jax.model.transformer import init

    config = model_config(4096, 0, "none")  # the weights do not depend on the length
    export_weights(jax.device_get(init(config, jax.random.key(seed))), config, directory)


def export_child(spec: dict) -> dict:
    export_hf_weights(spec["seed"], spec["weights_dir"])
    return {}


def side_record(result: dict) -> dict:
    record = dict(result)
    if "peak_rss_bytes" in record:
        record["peak_rss_gib"] = round(record.pop("peak_rss_bytes") / GIB, 3)
    return record


def row_for(seq: int, jax_result: dict, hf_result: dict) -> dict:
    row = {"benchmark": "long_context_vs_hf", "seq": seq, "batch": 1, "index_topk": INDEX_TOPK,
           "glm5_jax": side_record(jax_result), "hf": side_record(hf_result)}
    both_ok = jax_result.get("status") == "ok" and hf_result.get("status") == "ok"
    if both_ok:
        row["ratio_tokens_per_s"] = round(jax_result["tokens_per_s"] / hf_result["tokens_per_s"], 3)
        row["ratio_peak_rss"] = round(jax_result["peak_rss_bytes"] / hf_result["peak_rss_bytes"], 3)
    return row


def growth(rows: list[dict], side: str) -> dict | None:
    """ms/token at the longest length this side ran over ms/token at the shortest."""
    ran = [r for r in rows if r[side].get("status") == "ok"]
    if len(ran) < 2:
        return None
    first, last = ran[0], ran[-1]
    return {"from_seq": first["seq"], "to_seq": last["seq"],
            "ms_per_token_ratio": round(last[side]["ms_per_token"] / first[side]["ms_per_token"], 3)}


def hf_extrapolated(rows: list[dict], seq: int) -> dict | None:
    """HF's ms/token at `seq` from a straight line through the last two lengths it ran (its attention work per
    token is linear in S), and glm5_jax's measured speed against it. An estimate, labelled so: where HF does not
    fit, nothing measures it."""
    ran = [(r["seq"], r["hf"]["ms_per_token"]) for r in rows if r["hf"].get("status") == "ok"]
    if len(ran) < 2 or seq <= ran[-1][0]:
        return None
    (s0, t0), (s1, t1) = ran[-2], ran[-1]
    slope = (t1 - t0) / (s1 - s0)
    out = {"seq": seq, "basis": f"linear through HF's ms/token at {s0} and {s1}",
           "hf_ms_per_token_estimate": round(t0 + slope * (seq - s0), 3)}
    jax_row = next((r for r in rows if r["seq"] == seq and r["glm5_jax"].get("status") == "ok"), None)
    if jax_row is not None:
        jax_ms = jax_row["glm5_jax"]["ms_per_token"]
        out["ratio_tokens_per_s_estimate"] = round(out["hf_ms_per_token_estimate"] / jax_ms, 3)
    return out


def summary(rows: list[dict], args: argparse.Namespace) -> dict:
    misfit = [r["seq"] for r in rows if r["hf"].get("status") == "does_not_fit"]
    at = {r["seq"]: r for r in rows}
    out = {"benchmark": "long_context_vs_hf", "summary": True, "mem_cap_gib": args.mem_cap_gib,
           "hf_first_seq_not_fitting": misfit[0] if misfit else None,
           "glm5_jax_time_per_token_growth": growth(rows, "glm5_jax"), "hf_time_per_token_growth": growth(rows, "hf")}
    row = at.get(16384)
    if row is None:
        out["target_16k"] = "not measured (16384 not in --seqs)"
    elif row["glm5_jax"].get("status") != "ok":
        out["target_16k"] = f"glm5_jax did not run at 16384: {row['glm5_jax'].get('status')}"
    elif row["hf"].get("status") == "ok":
        out["target_16k"] = {"ratio_tokens_per_s": row["ratio_tokens_per_s"], "ratio_peak_rss": row["ratio_peak_rss"],
                             "met": row["ratio_tokens_per_s"] >= 10 and row["ratio_peak_rss"] <= 0.25}
    else:
        jax_gib = row["glm5_jax"]["peak_rss_gib"]
        out["target_16k"] = (f"HF does not run at 16384 under {args.mem_cap_gib} GiB, so the speed ratio is "
                             f"unmeasured; glm5_jax peak {jax_gib} GiB = {jax_gib / args.mem_cap_gib:.3f} of the cap "
                             "HF exceeds")
        out["hf_extrapolated_16k"] = hf_extrapolated(rows, 16384)
    g = out["glm5_jax_time_per_token_growth"]
    if g and g["from_seq"] == min(SEQS) and g["to_seq"] == max(SEQS):
        out["target_growth_2k_to_32k"] = {"ratio": g["ms_per_token_ratio"], "met": g["ms_per_token_ratio"] <= 2}
    else:
        out["target_growth_2k_to_32k"] = f"not measured over 2048..32768 (glm5_jax ran {g})"
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=list(DEFAULT_SEQS),
                        help=f"sequence lengths (batch 1); the issue's full sweep is {' '.join(map(str, SEQS))}")
    parser.add_argument("--steps", type=int, default=2, help="timed steps below --long-seq (after 1 warm-up)")
    parser.add_argument("--long-steps", type=int, default=1, help="timed steps at lengths >= --long-seq")
    parser.add_argument("--long-seq", type=int, default=16384)
    parser.add_argument("--sides", nargs="+", default=["glm5_jax", "hf"], choices=["glm5_jax", "hf"])
    parser.add_argument("--mem-cap-gib", type=float, default=20.0,
                        help="address-space cap of each child (RLIMIT_AS), GiB; the default leaves the OS ~3 GiB of "
                             "a 24 GiB machine, so 'does not fit' means this machine's memory")
    parser.add_argument("--child-timeout-s", type=float, default=900.0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--hf-attention", default="eager", choices=HF_ATTENTION,
                        help="HF attention implementation (both materialise the [S, T] mask)")
    parser.add_argument("--mode", default="dsa_sparse", choices=TRAIN_MODES,
                        help="glm5_jax train mode (dsa_sparse trains the indexer too; pretrain does not)")
    parser.add_argument("--index-query-chunk", type=int, default=1024,
                        help="glm5_jax query rows the indexer and the sparse attention handle at once (0 = all; "
                             "bounds the [chunk, T] index scores and the [chunk, N, C+R] gathered rows)")
    parser.add_argument("--remat-policy", default="full", choices=REMAT_POLICIES,
                        help="glm5_jax per-layer remat ('full' keeps only the layer inputs and the indexer's "
                             "top-k, config.ALWAYS_SAVED, so memory grows slowly with the length)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for seq in args.seqs:
        if seq < 2 or seq % 128:
            parser.error(f"--seqs value {seq} is invalid: each length must be a positive multiple of 128")
    if args.seqs != sorted(set(args.seqs)):
        parser.error(f"--seqs={args.seqs} is invalid: lengths must be distinct and increasing")
    for name in ("steps", "long_steps", "long_seq", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if not 1 <= args.mem_cap_gib <= 64:
        parser.error(f"--mem-cap-gib={args.mem_cap_gib} is invalid: must be in [1, 64] GiB")
    if args.child_timeout_s <= 0:
        parser.error(f"--child-timeout-s={args.child_timeout_s} is invalid: must be > 0")
    if args.index_query_chunk < 0:
        parser.error(f"--index-query-chunk={args.index_query_chunk} is invalid: must be >= 0 (0 = no chunking)")
    for seq in args.seqs:
        if args.index_query_chunk and seq > args.index_query_chunk and seq % args.index_query_chunk:
            parser.error(f"--index-query-chunk={args.index_query_chunk} is invalid: must divide every --seqs value "
                         f"(not {seq}), or the indexer runs unchunked")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print(json.dumps({"benchmark": "long_context_vs_hf", "mem_cap_gib": args.mem_cap_gib, "mode": args.mode,
                      "hf_attention": args.hf_attention, "index_query_chunk": args.index_query_chunk,
                      "remat_policy": args.remat_policy, "cpu_count": os.cpu_count(),
                      "load_average": os.getloadavg()}), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="long_context_vs_hf_") as weights_dir:
        if "hf" in args.sides:
            exported = run_capped(f"{THIS}:export_child", {"seed": args.seed, "weights_dir": weights_dir},
                                  args.mem_cap_gib, args.child_timeout_s)
            if exported.get("status") != "ok":
                raise SystemExit(f"exporting the weights for HF failed: {exported}")
        hf_misfit_at = jax_misfit_at = None
        for seq in args.seqs:
            steps = args.long_steps if seq >= args.long_seq else args.steps
            spec = {"seq": seq, "steps": steps, "seed": args.seed}
            jax_result = {"status": "not_run"}
            if "glm5_jax" in args.sides and jax_misfit_at is not None:
                jax_result = {"status": "not_run", "reason": f"does not fit at {jax_misfit_at} already"}
            elif "glm5_jax" in args.sides:
                jax_result = run_capped(f"{THIS}:jax_child", dict(spec, mode=args.mode, remat_policy=args.remat_policy,
                                                                  index_query_chunk=args.index_query_chunk),
                                        args.mem_cap_gib, args.child_timeout_s)
                if jax_result.get("status") == "does_not_fit":
                    jax_misfit_at = seq
            hf_result = {"status": "not_run"}
            if "hf" in args.sides and hf_misfit_at is not None:
                hf_result = {"status": "not_run", "reason": f"does not fit at {hf_misfit_at} already"}
            elif "hf" in args.sides:
                hf_result = run_capped(f"{THIS}:hf_child", dict(spec, weights_dir=weights_dir, threads=args.threads,
                                                                hf_attention=args.hf_attention, optim=optim_dict()),
                                       args.mem_cap_gib, args.child_timeout_s)
                if hf_result.get("status") == "does_not_fit":
                    hf_misfit_at = seq
            row = row_for(seq, jax_result, hf_result)
            row["load_average"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(summary(rows, args)), flush=True)


if __name__ == "__main__":
    main()
