"""Long-context training step: glm5_jax in `dsa_sparse` mode against Hugging Face `GlmMoeDsaForCausalLM`.

The `small` config of train_step_vs_hf.py with `index_topk` 256, batch 1, fp32, MTP off, at sequence lengths
2K ... 32K. Both sides get the same weights (glm5_jax's init, exported to HF through `glm5_jax.convert.hf`)
and the same token batches (numpy, from --seed).
  glm5_jax  the jitted `make_train_step` in mode `dsa_sparse` (top-k attention on the `sparse` backend, LM loss,
            indexer KL over the selected set, AdamW, clip 1.0), per-layer remat `full` by default
            (--remat-policy), the indexer and the sparse attention run 1024 queries at a time
            (--index-query-chunk); the first step compiles and is not timed.
  HF        model.train(), loss.backward(), clip_grad_norm_(1.0), torch.optim.AdamW.step(); the first step
            is a warm-up. HF computes every [S, T] score and masks it to the top-k. Each --hf-variants entry is
            run and reported on its own (benchmarks/hf_variants.py): by default `eager` attention without
            checkpointing (HF's default) and `sdpa_checkpointed` (torch's fused attention with HF's gradient
            checkpointing, the counterpart of glm5_jax's remat).
Fairness: every side is pinned to the same --threads CPUs (benchmarks/cpu_limit.py: XLA's thread pools follow
the process's CPU affinity; torch also gets that many threads), gets the same warm-up and the same number of
timed steps, and the sides take turns in --rounds rounds (ABBA order, benchmarks/repeats.py), so a load that
drifts during the run falls on all of them. Each side's figure is the median over all its timed steps, with
the min and max beside it and the per-round medians.
Each (side, length, round) runs in its own child process capped at --mem-cap-gib of address space (RLIMIT_AS;
see benchmarks/capped_child.py), which reports its peak RSS (getrusage ru_maxrss; the row keeps the largest
over rounds); a side that needs more fails inside the child and is recorded as "does_not_fit" at the cap. Once
a side does not fit at a length, its later rounds and longer lengths are recorded as not run (they need more).

One JSON line per length with every side's tokens/s, ms per token, step-time spread, peak RSS, first loss (the
same weights and tokens give the same first loss) and the ratios glm5_jax / each HF variant; then a summary
line per HF variant with the first length at which it does not fit, the growth of time per token from the
shortest to the longest length per side, and the issue-17 targets.

  PYTHONPATH=. python benchmarks/long_context_vs_hf.py [--seqs 2048 4096 8192 16384 32768] [--mem-cap-gib 20]
(default lengths 2048 4096, two rounds of two timed steps for each of the three sides)
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
from benchmarks.cpu_limit import limit_cpus
from benchmarks.hf_reference import adamw_train_runner
from benchmarks.repeats import spread_of, turn_order

SEQS = (2048, 4096, 8192, 16384, 32768)  # the lengths: --seqs 2048 4096 8192 16384 32768
# The default run stays under 10 minutes on 2 CPU cores; 16K and 32K are minutes per glm5_jax step there.
DEFAULT_SEQS = (2048, 4096)
INDEX_TOPK = 256
HF_VARIANTS = ("eager", "sdpa", "eager_checkpointed", "sdpa_checkpointed")  # benchmarks/hf_variants.py
DEFAULT_HF_VARIANTS = ("eager", "sdpa_checkpointed")
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
    """One child's record: its raw step times (pooled over rounds by the parent), warm-up time, first loss."""
    return {"step_times_s": [round(t, 4) for t in times], "first_step_s": round(first_s, 2),
            "first_loss": round(first_loss, 5)}


def jax_child(spec: dict) -> dict:
    """One glm5_jax measurement (runs in a capped child)."""
    limit_cpus(spec["threads"])  # before jax is imported and starts its CPU backend
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
    return summarise(*timed_steps(run, batches, 1), seq)


def hf_child(spec: dict) -> dict:
    """One HF measurement of one variant (runs in a capped child; imports no jax)."""
    limit_cpus(spec["threads"])
    from benchmarks.hf_variants import load_variant

    model = load_variant(spec["weights_dir"], spec["hf_variant"], spec["threads"])
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


def pooled_record(results: list[dict], seq: int) -> dict:
    """One side's record at one length from its rounds' child results: tokens/s from the median of all timed
    steps, their min-max, the per-round medians, the largest peak RSS; the first failure if a round failed."""
    failed = [r for r in results if r.get("status") != "ok"]
    if failed:
        record = dict(failed[0], rounds_ok=len(results) - len(failed))
        if "peak_rss_bytes" in record:
            record["peak_rss_gib"] = round(record.pop("peak_rss_bytes") / GIB, 3)
        return record
    times = [t for r in results for t in r["step_times_s"]]
    step = spread_of(times)
    return {"status": "ok", "tokens_per_s": round(seq / step["median_s"], 1),
            "ms_per_token": round(1e3 * step["median_s"] / seq, 4), "step_s": step,
            "round_median_step_s": [round(statistics.median(r["step_times_s"]), 4) for r in results],
            "warmup_step_s": [r["first_step_s"] for r in results], "first_loss": results[0]["first_loss"],
            "peak_rss_gib": round(max(r["peak_rss_bytes"] for r in results) / GIB, 3)}


def row_for(seq: int, jax_record: dict, hf_records: dict[str, dict]) -> dict:
    row = {"benchmark": "long_context_vs_hf", "seq": seq, "batch": 1, "index_topk": INDEX_TOPK,
           "glm5_jax": jax_record, "hf": hf_records, "ratio_tokens_per_s": {}, "ratio_peak_rss": {}}
    for variant, hf in hf_records.items():
        if jax_record.get("status") == "ok" and hf.get("status") == "ok":
            row["ratio_tokens_per_s"][variant] = round(jax_record["tokens_per_s"] / hf["tokens_per_s"], 3)
            row["ratio_peak_rss"][variant] = round(jax_record["peak_rss_gib"] / hf["peak_rss_gib"], 3)
    return row


def growth(records: list[tuple[int, dict]]) -> dict | None:
    """ms/token at the longest length a side ran over ms/token at the shortest; records = [(seq, record)]."""
    ran = [(seq, r) for seq, r in records if r.get("status") == "ok"]
    if len(ran) < 2:
        return None
    (first_seq, first), (last_seq, last) = ran[0], ran[-1]
    return {"from_seq": first_seq, "to_seq": last_seq,
            "ms_per_token_ratio": round(last["ms_per_token"] / first["ms_per_token"], 3)}


def hf_extrapolated(rows: list[dict], variant: str, seq: int) -> dict | None:
    """An HF variant's ms/token at `seq` from a straight line through the last two lengths it ran (its attention
    work per token is linear in S), and glm5_jax's measured speed against it. An estimate, labelled so: where
    HF does not fit, nothing measures it."""
    ran = [(r["seq"], r["hf"][variant]["ms_per_token"]) for r in rows if r["hf"][variant].get("status") == "ok"]
    if len(ran) < 2 or seq <= ran[-1][0]:
        return None
    (s0, t0), (s1, t1) = ran[-2], ran[-1]
    slope = (t1 - t0) / (s1 - s0)
    out = {"seq": seq, "basis": f"linear through HF's ms/token at {s0} and {s1}",
           "hf_ms_per_token_estimate": round(t0 + slope * (seq - s0), 3)}
    jax_row = next((r for r in rows if r["seq"] == seq and r["glm5_jax"].get("status") == "ok"), None)
    if jax_row is not None:
        out["ratio_tokens_per_s_estimate"] = round(out["hf_ms_per_token_estimate"]
                                                   / jax_row["glm5_jax"]["ms_per_token"], 3)
    return out


def target_16k(rows: list[dict], variant: str, cap_gib: float) -> dict | str:
    row = next((r for r in rows if r["seq"] == 16384), None)
    if row is None:
        return "not measured (16384 not in --seqs)"
    if row["glm5_jax"].get("status") != "ok":
        return f"glm5_jax did not run at 16384: {row['glm5_jax'].get('status')}"
    if row["hf"][variant].get("status") == "ok":
        ratio, rss = row["ratio_tokens_per_s"][variant], row["ratio_peak_rss"][variant]
        return {"ratio_tokens_per_s": ratio, "ratio_peak_rss": rss, "met": ratio >= 10 and rss <= 0.25}
    jax_gib = row["glm5_jax"]["peak_rss_gib"]
    return (f"HF ({variant}) does not run at 16384 under {cap_gib} GiB, so the speed ratio is unmeasured; glm5_jax "
            f"peak {jax_gib} GiB = {jax_gib / cap_gib:.3f} of the cap HF exceeds")


def summary(rows: list[dict], args: argparse.Namespace) -> dict:
    jax_growth = growth([(r["seq"], r["glm5_jax"]) for r in rows])
    out = {"benchmark": "long_context_vs_hf", "summary": True, "mem_cap_gib": args.mem_cap_gib,
           "threads": args.threads, "rounds": args.rounds, "glm5_jax_time_per_token_growth": jax_growth, "hf": {}}
    for variant in (args.hf_variants if "hf" in args.sides else []):
        misfit = [r["seq"] for r in rows if r["hf"][variant].get("status") == "does_not_fit"]
        hf = {"first_seq_not_fitting": misfit[0] if misfit else None,
              "time_per_token_growth": growth([(r["seq"], r["hf"][variant]) for r in rows]),
              "target_16k": target_16k(rows, variant, args.mem_cap_gib)}
        if isinstance(hf["target_16k"], str) and hf["target_16k"].startswith("HF"):
            hf["extrapolated_16k"] = hf_extrapolated(rows, variant, 16384)
        out["hf"][variant] = hf
    if jax_growth and jax_growth["from_seq"] == min(SEQS) and jax_growth["to_seq"] == max(SEQS):
        out["target_growth_2k_to_32k"] = {"ratio": jax_growth["ms_per_token_ratio"],
                                          "met": jax_growth["ms_per_token_ratio"] <= 2}
    else:
        out["target_growth_2k_to_32k"] = f"not measured over 2048..32768 (glm5_jax ran {jax_growth})"
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=list(DEFAULT_SEQS),
                        help=f"sequence lengths (batch 1); the issue's full sweep is {' '.join(map(str, SEQS))}")
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps per round below --long-seq (after 1 warm-up), the same for every side")
    parser.add_argument("--long-steps", type=int, default=1, help="timed steps per round at lengths >= --long-seq")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per length; the sides take turns in ABBA order, a fresh child each")
    parser.add_argument("--long-seq", type=int, default=16384)
    parser.add_argument("--sides", nargs="+", default=["glm5_jax", "hf"], choices=["glm5_jax", "hf"])
    parser.add_argument("--mem-cap-gib", type=float, default=20.0,
                        help="address-space cap of each child (RLIMIT_AS), GiB; the default leaves the OS ~3 GiB of "
                             "a 24 GiB machine, so 'does not fit' means this machine's memory")
    parser.add_argument("--child-timeout-s", type=float, default=900.0)
    parser.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))),
                        help="CPUs every side is pinned to (and torch's intra-op threads)")
    parser.add_argument("--hf-variants", nargs="+", default=list(DEFAULT_HF_VARIANTS), choices=HF_VARIANTS,
                        help="HF settings to run, each reported beside glm5_jax (attention implementation, with or "
                             "without gradient checkpointing; every one materialises the [S, T] mask)")
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
    for name in ("steps", "long_steps", "long_seq", "threads", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if args.threads > len(os.sched_getaffinity(0)):
        parser.error(f"--threads={args.threads} is invalid: this process may use {len(os.sched_getaffinity(0))} CPUs")
    if len(set(args.hf_variants)) != len(args.hf_variants):
        parser.error(f"--hf-variants={args.hf_variants} is invalid: name each variant once")
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


def measure_length(args: argparse.Namespace, seq: int, weights_dir: str, misfit_at: dict[str, int]) -> dict:
    """Every side at one length, taking turns over the rounds; `misfit_at` (side -> length) carries the lengths
    at which a side stopped fitting, so it is not run again at this or any longer length."""
    steps = args.long_steps if seq >= args.long_seq else args.steps
    spec = {"seq": seq, "steps": steps, "seed": args.seed, "threads": args.threads}
    sides = (["glm5_jax"] if "glm5_jax" in args.sides else []) + (
        [f"hf_{v}" for v in args.hf_variants] if "hf" in args.sides else [])
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for _, side in turn_order(sides, args.rounds):
        if side in misfit_at:
            continue
        if side == "glm5_jax":
            result = run_capped(f"{THIS}:jax_child", dict(spec, mode=args.mode, remat_policy=args.remat_policy,
                                                          index_query_chunk=args.index_query_chunk),
                                args.mem_cap_gib, args.child_timeout_s)
        else:
            result = run_capped(f"{THIS}:hf_child", dict(spec, weights_dir=weights_dir, hf_variant=side[3:],
                                                         optim=optim_dict()), args.mem_cap_gib, args.child_timeout_s)
        results[side].append(result)
        if result.get("status") == "does_not_fit":
            misfit_at[side] = seq

    def record(side: str) -> dict:
        if side not in results:
            return {"status": "not_run"}
        if not results[side]:
            return {"status": "not_run", "reason": f"does not fit at {misfit_at[side]} already"}
        return pooled_record(results[side], seq)

    row = row_for(seq, record("glm5_jax"), {v: record(f"hf_{v}") for v in args.hf_variants})
    row["timed_steps_per_round"] = steps
    row["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    print(json.dumps({"benchmark": "long_context_vs_hf", "mem_cap_gib": args.mem_cap_gib, "mode": args.mode,
                      "hf_variants": args.hf_variants, "index_query_chunk": args.index_query_chunk,
                      "remat_policy": args.remat_policy, "threads": args.threads, "rounds": args.rounds,
                      "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}), flush=True)
    rows, misfit_at = [], {}
    with tempfile.TemporaryDirectory(prefix="long_context_vs_hf_") as weights_dir:
        if "hf" in args.sides:
            exported = run_capped(f"{THIS}:export_child", {"seed": args.seed, "weights_dir": weights_dir},
                                  args.mem_cap_gib, args.child_timeout_s)
            if exported.get("status") != "ok":
                raise SystemExit(f"exporting the weights for HF failed: {exported}")
        for seq in args.seqs:
            rows.append(measure_length(args, seq, weights_dir, misfit_at))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(summary(rows, args)), flush=True)


if __name__ == "__main__":
    main()
