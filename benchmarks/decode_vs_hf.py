"""Rollout decoding: glm5_jax's latent-cache generation against Hugging Face `generate`, and MTP speculative
decoding on a trained model.

Part 1, vs HF. The `small` config of train_step_vs_hf.py with `index_topk` 256, fp32, the same weights on both
sides (glm5_jax's init exported through `glm5_jax.convert.hf`), batch --batch of random prompts of each
--prompt-lens length, --new-tokens tokens each, greedy, no EOS stop.
  glm5_jax  `glm5_jax.generation.generate` (jitted prefill, then one jitted decode step per token over the
            absorbed-form latent cache with DSA top-k; compiled in an untimed first call)
  HF        `model.generate(do_sample=False, min_new_tokens=max_new_tokens)` with its DynamicCache (which also
            stores the latent, but re-expands every cached position through kv_b_proj at every step)
Each --hf-variants entry (benchmarks/hf_variants.py: `eager`, HF's default, and `sdpa`, torch's fused attention)
runs and is reported on its own, in eval mode. Every side gets the same untimed warm-up (glm5_jax: the compiling
calls; HF: a 2-token generation) and then --repeats timed pairs of calls: prefill = a call with
max_new_tokens=1, then a call with --new-tokens; decode time = the second minus the first of each pair. The
sides take turns in --rounds rounds (ABBA order, each round a fresh child per side) and are pinned to the same
--threads CPUs (benchmarks/cpu_limit.py; torch also gets that many threads). Reported per side: the medians over
all pairs of every round, with their min and max; prefill tokens/s = batch x prompt / prefill time, decode
tokens/s = batch x (new - 1) / decode time. Cache bytes per
token and layer are read from the actual cache arrays (glm5_jax: the state `prefill` returns; HF: the
DynamicCache `generate` returns) and checked against (kv_lora_rank + qk_rope_head_dim + index_head_dim) x 4.
The generated tokens of both sides are compared token by token. They cannot be expected to match once the
indexer prunes: at random init ReLU leaves many index scores exactly 0, `jax.lax.top_k` and `torch.topk` keep
different keys tied at the k-th score (SPEC 2.2.6; `benchmarks/topk_ties_vs_hf.py` shows every first-layer
difference is such a tie), and greedy decoding amplifies the change. So a first run (--exact-check-len) keeps
every position within index_topk keys, where no tie can matter: there the tokens must be identical. Each side
runs in its own child process, capped at --mem-cap-gib (benchmarks/capped_child.py), which also reports its peak
RSS (the row keeps the largest over rounds).

Part 2, MTP (--mtp-run-dir, a run of `configs/train_tiny_stdlib.yaml` trained with `model.mtp_num_steps=3`):
plain `generate` against `speculative_generate` (3 drafts per verify step) on its latest checkpoint, at
temperature 1 (and greedy for reference), batch --batch of byte-tokenized prompts cut from Python standard
library files; reports the mean accepted length per verify step and the decode speed-up.

  PYTHONPATH=. python benchmarks/decode_vs_hf.py [--prompt-lens 1024 4096] [--mtp-run-dir /tmp/run]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.capped_child import GIB, run_capped
from benchmarks.cpu_limit import limit_cpus
from benchmarks.repeats import spread_of, turn_order

INDEX_TOPK = 256
THIS = "benchmarks.decode_vs_hf"
HF_VARIANTS = ("eager", "sdpa")  # inference: gradient checkpointing does not apply


def model_config(max_len: int):
    import dataclasses

    from benchmarks.train_step_vs_hf import CONFIGS

    return dataclasses.replace(CONFIGS["small"], index_topk=INDEX_TOPK, max_position_embeddings=max(max_len, 4096))


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, prompt_len), dtype=np.int32)


def expected_cache_bytes_per_token(c: dict) -> int:
    """Per layer: the absorbed-form row [c ; k_rope] plus the indexer key, fp32."""
    return (c["kv_lora_rank"] + c["qk_rope_head_dim"] + c["index_head_dim"]) * 4


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def timed_pairs(prefill_call, full_call, repeats: int) -> tuple[dict, object]:
    """`repeats` (prefill, full) timed pairs: {"prefill_times_s", "full_times_s"}, and the last full output."""
    prefill, full, out = [], [], None
    for _ in range(repeats):
        prefill.append(timed(prefill_call)[0])
        elapsed, out = timed(full_call)
        full.append(elapsed)
    return {"prefill_times_s": [round(t, 4) for t in prefill], "full_times_s": [round(t, 4) for t in full]}, out


def speeds(batch: int, prompt_len: int, new_tokens: int, prefill_times: list[float], full_times: list[float]) -> dict:
    """Medians and spreads of prefill, full and decode (= full - prefill of the same pair) times, and speeds."""
    prefill, full = spread_of(prefill_times), spread_of(full_times)
    decode = spread_of([f - p for p, f in zip(prefill_times, full_times)])
    return {"prefill_s": prefill, "generate_s": full, "decode_s": decode,
            "prefill_tokens_per_s": round(batch * prompt_len / prefill["median_s"], 1),
            "decode_tokens_per_s": round(batch * (new_tokens - 1) / decode["median_s"], 1),
            "decode_ms_per_step": round(1e3 * decode["median_s"] / (new_tokens - 1), 2)}


def jax_child(spec: dict) -> dict:
    """glm5_jax generation (capped child): timings, cache bytes, tokens saved to spec["tokens_out"]."""
    limit_cpus(spec["threads"])  # before jax is imported and starts its CPU backend
    import jax

    from glm5_jax.generation import SamplingParams, generate
    from glm5_jax.generation.decode import prefill
    from glm5_jax.generation.sampling import split_sampling
    from glm5_jax.model.transformer import init

    batch, prompt_len, new = spec["batch"], spec["prompt_len"], spec["new_tokens"]
    max_len = prompt_len + new
    config = model_config(max_len)
    params = init(config, jax.random.key(spec["seed"]))
    prompts = random_prompts(config.vocab_size, batch, prompt_len, spec["seed"] + 1)
    one, full = SamplingParams(temperature=0.0, max_new_tokens=1), SamplingParams(temperature=0.0, max_new_tokens=new)

    def run(sampling):
        return generate(params, prompts, config=config, sampling=sampling, max_len=max_len)

    compile_s = timed(lambda: run(one))[0] + timed(lambda: run(full))[0]  # the warm-up: first calls compile
    times, out = timed_pairs(lambda: run(one), lambda: run(full), spec["repeats"])
    np.save(spec["tokens_out"], out.tokens)
    # The cache the decode steps read, as `generate` builds it (same compiled prefill).
    nucleus, values = split_sampling(full)
    state, _ = prefill(params, jax.numpy.asarray(prompts), jax.numpy.full((batch,), prompt_len, jax.numpy.int32),
                       jax.random.key(0), values, config=config, nucleus=nucleus, max_len=max_len,
                       max_new_tokens=new, collect_routing=False, return_logits=False)
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(state.cache))
    per_token_layer = cache_bytes / (config.num_hidden_layers * batch * max_len)
    return {**times, "warmup_s": round(compile_s, 1),
            "cache_bytes": int(cache_bytes), "cache_bytes_per_token_per_layer": per_token_layer,
            "cache_shapes": {k: list(v.shape) for k, v in state.cache._asdict().items()}}


def hf_cache_bytes(cache) -> tuple[int, int]:
    """(bytes, cached positions) of a DynamicCache of GlmMoeDsa layers (latent keys, rope values, indexer keys)."""
    total, positions = 0, 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values, getattr(layer, "indexer_keys", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        positions = layer.keys.shape[-2]
    return total, positions


def hf_child(spec: dict) -> dict:
    """HF generation of one variant (capped child; no jax): timings, cache bytes, tokens saved to
    spec["tokens_out"]."""
    limit_cpus(spec["threads"])
    import torch

    from benchmarks.hf_variants import load_variant

    model = load_variant(spec["weights_dir"], spec["hf_variant"], spec["threads"]).eval()
    batch, prompt_len, new = spec["batch"], spec["prompt_len"], spec["new_tokens"]
    prompts = torch.from_numpy(random_prompts(model.config.vocab_size, batch, prompt_len, spec["seed"] + 1)).long()

    def run(max_new):
        with torch.no_grad():
            return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=max_new, min_new_tokens=max_new, eos_token_id=None, pad_token_id=0,
                                  use_cache=True, return_dict_in_generate=True)

    warmup_s = timed(lambda: run(2))[0]  # the warm-up (allocator, kernels)
    times, out = timed_pairs(lambda: run(1), lambda: run(new), spec["repeats"])
    tokens = out.sequences[:, prompt_len:].numpy().astype(np.int32)
    np.save(spec["tokens_out"], tokens)
    cache_bytes, positions = hf_cache_bytes(out.past_key_values)
    per_token_layer = cache_bytes / (model.config.num_hidden_layers * batch * positions)
    return {**times, "warmup_s": round(warmup_s, 1), "cache_bytes": int(cache_bytes),
            "cache_positions": positions, "cache_bytes_per_token_per_layer": per_token_layer,
            "cache_implementation": type(out.past_key_values).__name__}


def export_child(spec: dict) -> dict:
    import jax

    from benchmarks.hf_reference import export_weights
    from glm5_jax.model.transformer import init

    config = model_config(32768)  # the weights do not depend on it; HF positions up to 32K
    export_weights(jax.device_get(init(config, jax.random.key(spec["seed"]))), config, spec["weights_dir"])
    c = config
    return {"config": {k: getattr(c, k) for k in ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim",
                                                  "num_hidden_layers", "vocab_size", "hidden_size")}}


def token_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    same = a == b
    first_diff = [int(np.argmin(row)) if not row.all() else None for row in same]
    return {"tokens_identical": bool(same.all()), "fraction_equal": round(float(same.mean()), 4),
            "rows_identical": int(same.all(1).sum()), "first_divergence_per_row": first_diff}


def side_record(result: dict) -> dict:
    record = dict(result)
    if "peak_rss_bytes" in record:
        record["peak_rss_gib"] = round(record.pop("peak_rss_bytes") / GIB, 3)
    return record


def pooled_record(results: list[dict], batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One side's record from its rounds: speeds from the medians over every timed pair, the spreads, the
    per-round decode medians, the largest peak RSS, the cache figures of the first round; the first failure
    if a round failed."""
    failed = [r for r in results if r.get("status") != "ok"]
    if failed:
        return side_record(dict(failed[0], rounds_ok=len(results) - len(failed)))
    prefill = [t for r in results for t in r["prefill_times_s"]]
    full = [t for r in results for t in r["full_times_s"]]
    record = {key: value for key, value in results[0].items()
              if key not in ("prefill_times_s", "full_times_s", "peak_rss_bytes", "warmup_s")}
    record.update(speeds(batch, prompt_len, new_tokens, prefill, full))
    record["round_decode_median_s"] = [speeds(batch, prompt_len, new_tokens, r["prefill_times_s"], r["full_times_s"])
                                       ["decode_s"]["median_s"] for r in results]
    record["warmup_s"] = [r["warmup_s"] for r in results]
    record["peak_rss_gib"] = round(max(r["peak_rss_bytes"] for r in results) / GIB, 3)
    return record


def measure_vs_hf(args: argparse.Namespace, prompt_len: int, weights_dir: str, config: dict,
                  new_tokens: int | None = None) -> dict:
    new_tokens = args.new_tokens if new_tokens is None else new_tokens
    spec = {"batch": args.batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "seed": args.seed,
            "repeats": args.repeats, "threads": args.threads}
    out_dir = Path(weights_dir)
    sides = ["glm5_jax"] + [f"hf_{v}" for v in args.hf_variants]
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for _, side in turn_order(sides, args.rounds):
        if any(r.get("status") == "does_not_fit" for r in results[side]):
            continue
        tokens_out = str(out_dir / f"{side}_{prompt_len}.npy")
        if side == "glm5_jax":
            result = run_capped(f"{THIS}:jax_child", dict(spec, tokens_out=tokens_out), args.mem_cap_gib,
                                args.child_timeout_s)
        else:
            result = run_capped(f"{THIS}:hf_child", dict(spec, tokens_out=tokens_out, weights_dir=weights_dir,
                                                         hf_variant=side[3:]), args.mem_cap_gib, args.child_timeout_s)
        results[side].append(result)
    records = {side: pooled_record(results[side], args.batch, prompt_len, new_tokens) for side in sides}
    jax_record = records["glm5_jax"]
    row = {"benchmark": "decode_vs_hf", "batch": args.batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "index_topk": INDEX_TOPK, "indexer_prunes": prompt_len + new_tokens > INDEX_TOPK,
           "repeats_per_round": args.repeats, "rounds": args.rounds, "threads": args.threads,
           "glm5_jax": jax_record, "hf": {v: records[f"hf_{v}"] for v in args.hf_variants},
           "expected_cache_bytes_per_token_per_layer": expected_cache_bytes_per_token(config),
           "ratio_decode_tokens_per_s": {}, "ratio_prefill_tokens_per_s": {}, "agreement": {}}
    for variant, hf_record in row["hf"].items():
        if jax_record.get("status") != "ok" or hf_record.get("status") != "ok":
            continue
        row["ratio_decode_tokens_per_s"][variant] = round(jax_record["decode_tokens_per_s"]
                                                          / hf_record["decode_tokens_per_s"], 3)
        row["ratio_prefill_tokens_per_s"][variant] = round(jax_record["prefill_tokens_per_s"]
                                                           / hf_record["prefill_tokens_per_s"], 3)
        row[f"cache_bytes_per_token_per_layer_match_{variant}"] = all(
            r["cache_bytes_per_token_per_layer"] == row["expected_cache_bytes_per_token_per_layer"]
            for r in (jax_record, hf_record))
        row["agreement"][variant] = token_agreement(np.load(out_dir / f"glm5_jax_{prompt_len}.npy"),
                                                    np.load(out_dir / f"hf_{variant}_{prompt_len}.npy"))
    row["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return row


# ---------------------------------------------------------------- MTP speculative decoding (part 2)

def stdlib_prompts(batch: int, prompt_len: int) -> list[list[int]]:
    """Byte-tokenized prompts: the first prompt_len bytes of the `batch` largest standard-library modules
    whose names sort last (a fixed, reproducible choice)."""
    import sysconfig

    from glm5_jax.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    prompts = []
    for path in reversed(files):
        ids = tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
        if len(prompts) == batch:
            return prompts
    raise RuntimeError(f"fewer than {batch} stdlib modules hold {prompt_len} tokens")


def mtp_child(spec: dict) -> dict:
    """Plain vs speculative generation on the trained run's latest checkpoint (capped child)."""
    import jax

    from glm5_jax.config import load_model_config
    from glm5_jax.generation import SamplingParams, generate, speculative_generate
    from glm5_jax.parallel.sharding import abstract_params
    from glm5_jax.runner import load_params

    run_dir = Path(spec["run_dir"])
    config = load_model_config(run_dir / "config.yaml")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract_params(config))
    params = load_params(run_dir, like)
    prompts = stdlib_prompts(spec["batch"], spec["prompt_len"])
    new, drafts = spec["new_tokens"], spec["num_draft"]
    max_len = spec["prompt_len"] + new + drafts  # one cache length for every call: compiled once
    rows = {}
    for name, temperature in (("temperature_1", 1.0), ("greedy", 0.0)):
        one = SamplingParams(temperature=temperature, max_new_tokens=1)
        full = SamplingParams(temperature=temperature, max_new_tokens=new)
        calls = {
            "plain": lambda s: generate(params, prompts, config=config, sampling=s, max_len=max_len,
                                        rng=jax.random.key(spec["seed"])),
            "speculative": lambda s: speculative_generate(params, prompts, config=config, sampling=s,
                                                          num_draft=drafts, max_len=max_len,
                                                          rng=jax.random.key(spec["seed"])),
        }
        result = {}
        for kind, call in calls.items():
            call(one), call(full)  # compile
            times, out = timed_pairs(lambda: call(one), lambda: call(full), 3)
            result[kind] = {**speeds(len(prompts), spec["prompt_len"], new, times["prefill_times_s"],
                                     times["full_times_s"]), "mean_generated": float(out.lengths.mean())}
            if kind == "speculative":
                result[kind]["accepted_length_per_step"] = round(out.acceptance_length, 3)
            result[kind]["tokens"] = out.tokens.tolist()
        plain_tokens, spec_tokens = result["plain"].pop("tokens"), result["speculative"].pop("tokens")
        result["decode_speedup"] = round(result["plain"]["decode_s"]["median_s"]
                                         / result["speculative"]["decode_s"]["median_s"], 3)
        result["generate_speedup"] = round(result["plain"]["generate_s"]["median_s"]
                                           / result["speculative"]["generate_s"]["median_s"], 3)
        if temperature == 0:
            result["greedy_tokens_identical"] = plain_tokens == spec_tokens
        rows[name] = result
    return {"run_dir": str(run_dir), "mtp_num_steps": config.mtp_num_steps, "num_draft": drafts, **rows}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="*", default=[1024],
                        help="prompt lengths of the HF comparison (empty: skip it); 4096 is the long one")
    parser.add_argument("--exact-check-len", type=int, default=128,
                        help="first, a run of this prompt length and index_topk minus it new tokens: no position "
                             "sees more than index_topk keys, so the tokens must be identical (0: skip)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--mem-cap-gib", type=float, default=9.0, help="address-space cap of each child, GiB")
    parser.add_argument("--child-timeout-s", type=float, default=900.0)
    parser.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))),
                        help="CPUs every side is pinned to (and torch's intra-op threads)")
    parser.add_argument("--hf-variants", nargs="+", default=list(HF_VARIANTS), choices=HF_VARIANTS,
                        help="HF attention implementations to run, each reported beside glm5_jax")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed (prefill, full) pairs per side and round, the same for every side")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per prompt length; the sides take turns in ABBA order, a fresh child each")
    parser.add_argument("--mtp-run-dir", default="",
                        help="run directory of configs/train_tiny_stdlib.yaml trained with model.mtp_num_steps=3 "
                             "(empty: skip the MTP part)")
    parser.add_argument("--mtp-prompt-len", type=int, default=256)
    parser.add_argument("--mtp-new-tokens", type=int, default=128)
    parser.add_argument("--mtp-drafts", type=int, default=3, help="drafted tokens per verify step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch", "threads", "mtp_prompt_len", "mtp_drafts", "repeats", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    for name in ("new_tokens", "mtp_new_tokens"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 2 "
                         "(decode speed is measured over the tokens after the first)")
    if not 0 <= args.exact_check_len <= INDEX_TOPK - 2:
        parser.error(f"--exact-check-len={args.exact_check_len} is invalid: must be in [0, {INDEX_TOPK - 2}] "
                     f"(it leaves index_topk {INDEX_TOPK} minus it, at least 2, new tokens)")
    if args.threads > len(os.sched_getaffinity(0)):
        parser.error(f"--threads={args.threads} is invalid: this process may use {len(os.sched_getaffinity(0))} CPUs")
    if len(set(args.hf_variants)) != len(args.hf_variants):
        parser.error(f"--hf-variants={args.hf_variants} is invalid: name each variant once")
    for length in args.prompt_lens:
        if length < 1:
            parser.error(f"--prompt-lens value {length} is invalid: must be >= 1")
    if not 1 <= args.mem_cap_gib <= 64:
        parser.error(f"--mem-cap-gib={args.mem_cap_gib} is invalid: must be in [1, 64] GiB")
    if args.child_timeout_s <= 0:
        parser.error(f"--child-timeout-s={args.child_timeout_s} is invalid: must be > 0")
    if args.mtp_run_dir and not (Path(args.mtp_run_dir) / "checkpoints").is_dir():
        parser.error(f"--mtp-run-dir={args.mtp_run_dir} is invalid: must be a run directory holding checkpoints/ "
                     "(train one: glm5 train configs/train_tiny_stdlib.yaml model.mtp_num_steps=3 train.run_dir=DIR)")
    if not args.prompt_lens and not args.exact_check_len and not args.mtp_run_dir:
        parser.error("nothing to run: give --prompt-lens values, --exact-check-len and/or --mtp-run-dir")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print(json.dumps({"benchmark": "decode_vs_hf", "mem_cap_gib": args.mem_cap_gib, "hf_variants": args.hf_variants,
                      "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds,
                      "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}), flush=True)
    if args.prompt_lens or args.exact_check_len:
        with tempfile.TemporaryDirectory(prefix="decode_vs_hf_") as weights_dir:
            exported = run_capped(f"{THIS}:export_child", {"seed": args.seed, "weights_dir": weights_dir},
                                  args.mem_cap_gib, args.child_timeout_s)
            if exported.get("status") != "ok":
                raise SystemExit(f"exporting the weights for HF failed: {exported}")
            if args.exact_check_len:
                # Every position sees at most index_topk keys, so the indexer keeps all of them and no tie at
                # the k-th score can change the selection: both sides must produce the same tokens.
                row = measure_vs_hf(args, args.exact_check_len, weights_dir, exported["config"],
                                    new_tokens=INDEX_TOPK - args.exact_check_len)
                row["tokens_must_match"] = True
                print(json.dumps(row), flush=True)
            for prompt_len in args.prompt_lens:
                print(json.dumps(measure_vs_hf(args, prompt_len, weights_dir, exported["config"])), flush=True)
    if args.mtp_run_dir:
        result = run_capped(f"{THIS}:mtp_child", {"run_dir": str(Path(args.mtp_run_dir).resolve()),
                                                   "batch": args.batch, "prompt_len": args.mtp_prompt_len,
                                                   "new_tokens": args.mtp_new_tokens, "num_draft": args.mtp_drafts,
                                                   "seed": args.seed}, args.mem_cap_gib, args.child_timeout_s)
        print(json.dumps({"benchmark": "decode_mtp_speculative", **side_record(result),
                          "load_average": [round(x, 2) for x in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
