"""GPU check of the Pallas DSA kernels, one JSON line per measurement (stdout and --out).

1. correctness at a small GLM-5-shaped size (H=64, C=512, R=64, bf16) against the jnp references, for
   each block_n in --block-ns (which also shows which tile sizes compile): out / lse / dq / dlatent
   errors, indexer scores and their q / k / weights gradients, indexer top-k equality on exact (dyadic)
   scores and against the top-k of the kernel's own scores (`indexer_topk_checks`), KL-target errors, and the
   Triton flash attention over every visible key (out / dq / dk / dv, 64 heads of --flash-head-dim);
2. scaling at S = T in --seqs with N = --topk selected rows: forward and forward+backward time of the Pallas
   sparse attention, of cuDNN's causal flash attention in MLA's expanded form (64 heads of 256: the dense
   baseline a GPU trainer would use), of jax's Triton flash attention on the same inputs (what the model runs
   where the top-k keeps every key) and of dense causal latent attention over all keys (XLA, query-chunked and
   rematerialised so it fits), plus the indexer top-k forward; each with achieved TFLOP/s.

TFLOP/s counts useful matmul FLOPs per attended (query, key, head) triple (`attention_flops`): forward
2(C+R) + 2C, backward 6(C+R) + 4C; sparse attends the valid selected slots, dense the S(S+1)/2 causal
pairs, per head. Every measurement runs under try/except (an OOM or compile failure becomes an error
line), and no new measurement starts after --budget-s seconds.

  PYTHONPATH=. python benchmarks/gpu_kernels.py --out "$OUT/gpu_check.jsonl"
  PYTHONPATH=. python benchmarks/gpu_kernels.py --interpret --seqs 256 --topk 64 --heads 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import (
    NEG_INF,
    causal_flash_attention,
    dense_attention_target,
    indexer_scores,
    indexer_topk,
    sparse_attention_target,
    sparse_mla_attention,
)
from pallas_kernels.gpu_flash_attention import triton_flash_plan
from pallas_kernels.reference import (
    causal_flash_attention_reference,
    dense_attention_target_reference,
    indexer_scores_reference,
    indexer_topk_reference,
    sparse_attention_target_reference,
    sparse_mla_attention_reference,
    topk_with_scores,
)

START = time.perf_counter()
PATHS = ("pallas_sparse", "dense_flash", "pallas_flash", "indexer_topk", "dense_xla")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="append JSON lines here too")
    parser.add_argument("--seqs", default="8192,16384,32768,65536")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--index-heads", type=int, default=32)
    parser.add_argument("--index-dim", type=int, default=128)
    parser.add_argument("--block-ns", default="64,32", help="block_n values to check; the first that passes is timed")
    parser.add_argument("--check-seq", type=int, default=1024)
    parser.add_argument("--dense-chunk", type=int, default=256, help="queries per step of the dense baseline")
    parser.add_argument("--paths", default="pallas_sparse,dense_flash,indexer_topk,dense_xla",
                        help="scaling paths to time (dense_flash: cuDNN flash attention, expanded form; "
                             "pallas_flash: jax's Triton flash attention as the model runs it where the top-k "
                             "keeps every key)")
    parser.add_argument("--flash-head-dim", type=int, default=256, help="dense_flash's query-key and value head dim")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=380.0)
    parser.add_argument("--interpret", action="store_true", help="run the kernels in interpret mode (CPU smoke run)")
    parser.add_argument("--no-correctness", action="store_true",
                        help="time only (the first --block-ns value): the correctness pass ran in another call")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.paths.split(",")) - set(PATHS))
    if unknown:
        parser.error(f"--paths {','.join(unknown)} is invalid: choose from {','.join(PATHS)}")
    return args


class Recorder:
    def __init__(self, path: str | None):
        self.path = path

    def emit(self, **record) -> None:
        line = json.dumps({"elapsed_s": round(time.perf_counter() - START, 1), **record})
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    @contextlib.contextmanager
    def guard(self, what: str, **context):
        """Turns any exception of the block into an error line: one OOM or compile failure must not stop
        the rest of the run."""
        try:
            yield
        except Exception as error:
            self.emit(check=what, **context, error=f"{type(error).__name__}: {str(error)[:1500]}",
                      where=traceback.format_exc(limit=-3)[-1500:])


def timed_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def attention_flops(triples: float, c_dim: int, r_dim: int) -> tuple[float, float]:
    """(forward, forward+backward) matmul FLOPs for `triples` (query, key, head) scores.

    Forward: q.k over C+R and p.v over C. Backward: q.k recomputed (C+R), dp = do.v (C), dq = ds.k (C+R),
    dk = ds.q (C+R), dv = p.do (C)."""
    forward = 2 * triples * ((c_dim + r_dim) + c_dim)
    backward = 2 * triples * (3 * (c_dim + r_dim) + 2 * c_dim)
    return forward, forward + backward


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def random_causal_indices(rng, q_len: int, num_keys: int, topk: int) -> jax.Array:
    indices = np.full((1, q_len, topk), -1, np.int32)
    for s in range(q_len):
        count = min(topk, s + 1, num_keys)
        indices[0, s, rng.choice(topk, size=count, replace=False)] = rng.choice(s + 1, size=count, replace=False)
    return jnp.asarray(indices)


def strided_causal_indices(q_len: int, topk: int) -> jax.Array:
    """Distinct causal keys per query spread over its history (built on device, S x N int32)."""
    s = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    keys = s - jnp.maximum(1, (s + 1) // topk) * jnp.arange(topk, dtype=jnp.int32)[None, :]
    return jnp.where(keys >= 0, keys, -1)[None]


def dense_causal_attention(q, latent, *, scale, kv_lora_rank, chunk):
    """Causal latent attention over all keys, `chunk` queries at a time ([B, H, chunk, T] scores), each
    chunk rematerialised in the backward so no [B, H, S, T] tensor is ever live."""
    batch, q_len, heads, width = q.shape
    num_keys = latent.shape[1]
    values = latent[..., :kv_lora_rank]

    @jax.checkpoint
    def one_chunk(args):
        q_chunk, start = args
        logits = jnp.einsum("BSHX,BTX->BHST", q_chunk, latent, preferred_element_type=jnp.float32) * scale
        causal = jnp.arange(num_keys)[None, :] <= start + jnp.arange(chunk)[:, None]
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(q.dtype)
        return jnp.einsum("BHST,BTC->BSHC", probs, values)

    chunks = q.reshape(batch, q_len // chunk, chunk, heads, width).swapaxes(0, 1)
    out = lax.map(one_chunk, (chunks, jnp.arange(q_len // chunk) * chunk))
    return out.swapaxes(0, 1).reshape(batch, q_len, heads, kv_lora_rank)


def flash_implementation() -> str | None:
    """cuDNN's fused flash attention on a GPU; elsewhere (the CPU smoke run) XLA's."""
    return "cudnn" if jax.default_backend() == "gpu" else None


def flash_attention(q, kv, *, implementation):
    """Causal attention in MLA's expanded form (per-head keys and values of --flash-head-dim: GLM-5's 192 + 64
    query-key and 256 value dims), the dense baseline a GPU trainer would run; kv stacks keys and values."""
    return jax.nn.dot_product_attention(q, kv[0], kv[1], is_causal=True, implementation=implementation)


def sum_of_squares_grad(fn):
    def loss(q, latent):
        return jnp.sum(jnp.square(fn(q, latent).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def indexer_score_errors(args, q_len: int) -> dict[str, float]:
    """Relative errors of the indexer scores kernel (bf16 inputs) and of its gradients in q, k and weights
    against the reference, on the visible (causal) scores."""
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (1, q_len, args.index_heads, args.index_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, q_len, args.index_dim), jnp.bfloat16)
    w = jax.random.normal(keys[2], (1, q_len, args.index_heads), jnp.float32)
    cotangent = jax.random.normal(keys[3], (1, q_len, q_len), jnp.float32)

    def run(fn, **extra):
        @jax.jit
        def go(q, k, w):
            scores, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, **extra), q, k, w)
            visible = scores > NEG_INF / 2
            return (jnp.where(visible, scores, 0.0), *vjp(jnp.where(visible, cotangent, 0.0)))
        return go(q, k, w)

    got = run(indexer_scores, interpret=args.interpret)
    want = run(indexer_scores_reference)
    return {f"indexer_{name}": relative_error(g, w)
            for name, g, w in zip(("scores", "dq", "dk", "dweights"), got, want)}


def indexer_topk_checks(args, q_len: int, topk: int) -> dict:
    """The top-k kernel's selection, two ways.

    exact: integer q, k and quarter-integer weights at J = 64, where the scale J^-0.5 = 1/8 is a power of two,
    so every score is exact in fp32 whatever the order of its sums: the indices (ties by lowest key) and the
    scores must equal the reference's. (At J = 128 the scale 2^-3.5 rounds, and a GPU's reference einsum sums in
    another order than the kernel: scores then differ in the last bit and near-ties swap.)
    own scores: bf16 inputs at --index-dim; the kernel's indices must be the reference top-k rule applied to the
    kernel's own scores (`indexer_scores`), and their overlap with the reference's selection is reported."""
    rng = np.random.default_rng(1)
    exact_dim = 64
    qi = jnp.asarray(rng.integers(-2, 3, (1, q_len, args.index_heads, exact_dim)).astype(np.float32))
    ki = jnp.asarray(rng.integers(-2, 3, (1, q_len, exact_dim)).astype(np.float32))
    wi = jnp.asarray(rng.integers(-4, 5, (1, q_len, args.index_heads)).astype(np.float32) / 4)
    select = jax.jit(lambda a, b, c: indexer_topk(a, b, c, topk=topk, interpret=args.interpret))
    got_idx, got_val = select(qi, ki, wi)
    want_idx, want_val = indexer_topk_reference(qi, ki, wi, topk=topk)
    got_idx, want_idx = np.asarray(got_idx), np.asarray(want_idx)
    rows_differing = np.flatnonzero(np.any(got_idx != want_idx, axis=-1)[0])
    result = {"exact_indices_equal": bool(np.array_equal(got_idx, want_idx)),
              "exact_scores_equal": bool(np.array_equal(np.asarray(got_val), np.asarray(want_val))),
              "exact_rows_differing": int(rows_differing.size),
              "exact_first_row_differing": int(rows_differing[0]) if rows_differing.size else None}

    keys = jax.random.split(jax.random.key(5), 3)
    qb = jax.random.normal(keys[0], (1, q_len, args.index_heads, args.index_dim), jnp.bfloat16)
    kb = jax.random.normal(keys[1], (1, q_len, args.index_dim), jnp.bfloat16)
    wb = jax.random.normal(keys[2], (1, q_len, args.index_heads), jnp.float32)
    got_idx = np.asarray(select(qb, kb, wb)[0])
    own_scores = jax.jit(lambda a, b, c: indexer_scores(a, b, c, interpret=args.interpret))(qb, kb, wb)
    rule_idx = np.asarray(topk_with_scores(own_scores, topk)[0])
    want_idx = np.asarray(indexer_topk_reference(qb, kb, wb, topk=topk)[0])
    overlap = [len(np.intersect1d(g[g >= 0], w[w >= 0])) / max(1, int(np.sum(w >= 0)))
               for g, w in zip(got_idx[0], want_idx[0])]
    scores_diff = jnp.max(jnp.abs(own_scores - indexer_scores_reference(qb, kb, wb)))
    result.update(own_scores_indices_equal=bool(np.array_equal(got_idx, rule_idx)),
                  reference_overlap_min=round(min(overlap), 4), reference_overlap_mean=round(float(np.mean(overlap)), 6),
                  scores_max_abs_diff=float(scores_diff))
    return result


def flash_errors(args, q_len: int) -> dict[str, float]:
    """Relative errors of the Triton flash attention (bf16, causal, two packed segments) and of its q / k / v
    gradients against fp32 masked attention."""
    keys = jax.random.split(jax.random.key(3), 4)
    shape = (1, q_len, args.heads, args.flash_head_dim)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    segments = jnp.where(jnp.arange(q_len) < q_len // 3, 1, 2)[None]
    scale = args.flash_head_dim ** -0.5

    def run(fn):
        @jax.jit
        def go(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(d_out.astype(out.dtype)))
        return go(q, k, v)

    got = run(lambda q, k, v: causal_flash_attention(q, k, v, segments, scale=scale, interpret=args.interpret))
    want = run(lambda q, k, v: causal_flash_attention_reference(q, k, v, segments, scale=scale))
    return {f"flash_{name}": relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def check_correctness(args, rec: Recorder, block_n: int) -> bool:
    """Kernels against references at --check-seq; True when everything is within bf16 tolerance."""
    c_dim, r_dim, heads, q_len = args.kv_lora_rank, args.rope_dim, args.heads, args.check_seq
    topk = min(args.topk, q_len // 2)
    scale = (c_dim + r_dim) ** -0.5
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, q_len, heads, c_dim + r_dim), jnp.bfloat16)
    latent = jax.random.normal(keys[1], (1, q_len, c_dim + r_dim), jnp.bfloat16)
    indices = random_causal_indices(np.random.default_rng(0), q_len, q_len, topk)
    d_out = jax.random.normal(keys[2], (1, q_len, heads, c_dim), jnp.bfloat16)
    d_lse = jax.random.normal(keys[3], (1, q_len, heads), jnp.float32)
    kwargs = dict(scale=scale, kv_lora_rank=c_dim)

    def run(fn, **extra):
        @jax.jit
        def go(q, latent):
            (out, lse), vjp = jax.vjp(lambda a, b: fn(a, b, indices, **kwargs, **extra), q, latent)
            return (out, lse, *vjp((d_out, d_lse)))
        return go(q, latent)

    got = run(sparse_mla_attention, block_n=block_n, interpret=args.interpret)
    want = run(sparse_mla_attention_reference)
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "lse", "dq", "dlatent"), got, want)}
    lse = want[1]
    target = jax.jit(lambda q, l: sparse_attention_target(q, l, indices, lse, scale=scale, block_n=block_n,
                                                          interpret=args.interpret))(q, latent)
    errors["sparse_target"] = relative_error(target, sparse_attention_target_reference(q, latent, indices, lse,
                                                                                      scale=scale))
    dense = jax.jit(lambda q, l: dense_attention_target(q, l, scale=scale, interpret=args.interpret))(q, latent)
    errors["dense_target"] = relative_error(dense, dense_attention_target_reference(q, latent, scale=scale))
    errors.update(indexer_score_errors(args, q_len))
    errors.update(flash_errors(args, q_len))
    topk_checks = indexer_topk_checks(args, q_len, topk)
    indices_equal = topk_checks["exact_indices_equal"] and topk_checks["own_scores_indices_equal"]
    passed = all(v < 2e-2 for v in errors.values()) and indices_equal
    rec.emit(check="correctness", block_n=block_n, seq=q_len, topk=topk, heads=heads, dtype="bfloat16",
             relative_errors={k: round(v, 6) for k, v in errors.items()}, indexer_topk=topk_checks, passed=passed)
    return passed


def measure_scaling(args, rec: Recorder, block_n: int) -> None:
    c_dim, r_dim, heads = args.kv_lora_rank, args.rope_dim, args.heads
    scale = (c_dim + r_dim) ** -0.5
    for q_len in (int(s) for s in args.seqs.split(",")):
        topk = min(args.topk, q_len)
        keys = jax.random.split(jax.random.key(q_len), 5)
        q = jax.random.normal(keys[0], (1, q_len, heads, c_dim + r_dim), jnp.bfloat16)
        latent = jax.random.normal(keys[1], (1, q_len, c_dim + r_dim), jnp.bfloat16)
        indices = strided_causal_indices(q_len, topk)
        sparse_triples = heads * float(jnp.sum(indices >= 0))
        dense_triples = heads * q_len * (q_len + 1) / 2
        absorbed = (q, latent), (c_dim, r_dim)
        paths = {
            "pallas_sparse": (lambda a, b: sparse_mla_attention(a, b, indices, scale=scale, kv_lora_rank=c_dim,
                                                                block_n=block_n, interpret=args.interpret)[0],
                              sparse_triples, *absorbed),
            "dense_xla": (functools.partial(dense_causal_attention, scale=scale, kv_lora_rank=c_dim,
                                            chunk=min(args.dense_chunk, q_len)), dense_triples, *absorbed),
        }
        width = args.flash_head_dim
        q_e = jax.random.normal(keys[2], (1, q_len, heads, width), jnp.bfloat16)
        kv_e = jax.random.normal(keys[3], (2, 1, q_len, heads, width), jnp.bfloat16)
        paths["dense_flash"] = (functools.partial(flash_attention, implementation=flash_implementation()),
                                dense_triples, (q_e, kv_e), (width, 0))
        segments = jnp.ones((1, q_len), jnp.int32)
        paths["pallas_flash"] = (lambda q, kv: causal_flash_attention(q, kv[0], kv[1], segments, scale=width ** -0.5,
                                                                      interpret=args.interpret),
                                 dense_triples, (q_e, kv_e), (width, 0))
        wanted = args.paths.split(",")
        for name in (path for path in wanted if path in paths):  # in the order asked for: the budget may run out
            fn, triples, inputs, (value_dim, extra_key_dim) = paths[name]
            if time.perf_counter() - START > args.budget_s:
                rec.emit(check="scaling", path=name, seq=q_len, skipped="time budget spent")
                continue

            with rec.guard("scaling", path=name, seq=q_len):
                flops_fwd, flops_all = attention_flops(triples, value_dim, extra_key_dim)
                forward = jax.jit(fn).lower(*inputs).compile()
                fwd_ms = timed_ms(forward, *inputs, repeats=args.repeats)
                backward = sum_of_squares_grad(fn).lower(*inputs).compile()
                all_ms = timed_ms(backward, *inputs, repeats=args.repeats)
                memory = backward.memory_analysis()
                tile = {"block_n": block_n} if name == "pallas_sparse" else {}
                if name == "dense_flash":
                    tile = {"head_dim": value_dim, "implementation": flash_implementation() or "xla"}
                if name == "pallas_flash":
                    plan = triton_flash_plan(1, q_len, heads, value_dim, 2)
                    tile = {"head_dim": value_dim, "blocks": [plan.block_q, plan.block_k, plan.stages,
                                                              plan.block_bwd]}
                rec.emit(check="scaling", path=name, seq=q_len, topk=topk, heads=heads, **tile,
                         forward_ms=round(fwd_ms, 3), forward_tflops=round(flops_fwd / fwd_ms / 1e9, 2),
                         fwd_bwd_ms=round(all_ms, 3), fwd_bwd_tflops=round(flops_all / all_ms / 1e9, 2),
                         fwd_bwd_temp_gib=round(memory.temp_size_in_bytes / 2**30, 3))

        if "indexer_topk" not in wanted:
            continue
        if time.perf_counter() - START > args.budget_s:
            rec.emit(check="scaling", path="indexer_topk", seq=q_len, skipped="time budget spent")
            continue

        with rec.guard("scaling", path="indexer_topk", seq=q_len):
            qi = jax.random.normal(keys[2], (1, q_len, args.index_heads, args.index_dim), jnp.bfloat16)
            ki = jax.random.normal(keys[3], (1, q_len, args.index_dim), jnp.bfloat16)
            wi = jax.random.normal(keys[4], (1, q_len, args.index_heads), jnp.float32)
            select = jax.jit(lambda a, b, c: indexer_topk(a, b, c, topk=topk, interpret=args.interpret))
            ms = timed_ms(select.lower(qi, ki, wi).compile(), qi, ki, wi, repeats=args.repeats)
            # The same causal scores alone ([S, T] fp32 written whole): what the selection adds is the difference.
            score = jax.jit(lambda a, b, c: indexer_scores(a, b, c, interpret=args.interpret))
            scores_ms = timed_ms(score.lower(qi, ki, wi).compile(), qi, ki, wi, repeats=args.repeats)
            score_flops = 2 * q_len * q_len * args.index_heads * args.index_dim  # every tile is computed
            rec.emit(check="scaling", path="indexer_topk", seq=q_len, topk=topk, forward_ms=round(ms, 3),
                     score_tflops=round(score_flops / ms / 1e9, 2), scores_alone_ms=round(scores_ms, 3))


def main(argv=None) -> None:
    args = parse_args(argv)
    rec = Recorder(args.out)
    rec.emit(check="environment", jax=jax.__version__, backend=jax.default_backend(),
             device=jax.devices()[0].device_kind, interpret=args.interpret)
    block_ns = [int(b) for b in args.block_ns.split(",")]
    if args.no_correctness:
        measure_scaling(args, rec, block_ns[0])
        return
    for block_n in block_ns:
        passed = False
        with rec.guard("correctness", block_n=block_n):
            passed = check_correctness(args, rec, block_n)
        if passed:
            break
    else:  # still time dense attention and the indexer; the Pallas lines will show what fails
        block_n = block_ns[0]
        rec.emit(check="scaling", warning=f"no block_n passed the correctness check; timing block_n={block_n}")
    measure_scaling(args, rec, block_n)


if __name__ == "__main__":
    main()
