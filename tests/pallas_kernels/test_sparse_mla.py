"""Sparse MLA Pallas kernel (interpret mode) against the jnp reference: outputs, lse and gradients
(dq, dlatent, including through lse), on causal selections with invalid slots and shared rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import NEG_INF, sparse_mla_attention, sparse_mla_attention_with_target
from pallas_kernels.reference import sparse_mla_attention_reference


def causal_indices(rng, batch, q_len, num_keys, num_slots, q_offset):
    """Distinct valid keys per query among t <= q_offset + s, always including key 0 (shared by every
    query); the rest of the N slots are -1, scattered among the valid ones."""
    indices = np.full((batch, q_len, num_slots), -1, np.int32)
    for b in range(batch):
        for s in range(q_len):
            visible = min(q_offset + s + 1, num_keys)
            count = min(num_slots, visible, int(rng.integers(1, num_slots + 1)))
            keys = np.concatenate([[0], rng.choice(np.arange(1, visible), size=count - 1, replace=False)])
            indices[b, s, rng.choice(num_slots, size=count, replace=False)] = keys
    return indices


# (batch, q_len, keys, heads, C, R, N, block_n, dtype, q_offset): S = 1, N below / not a multiple of /
# a multiple of block_n, head counts 1, 4, 16, T > N, non-power-of-two C and R (GLM-5 tiny configs).
# "_unused_last": each query's valid slots first and its unused ones (-1) last, as the indexer's top-k returns
# them: up to 19 valid of 40 slots in blocks of 16, so every program stops after one or two of its three blocks.
CASES = {
    "h1_s1_bf16": (1, 1, 20, 1, 32, 16, 5, 16, jnp.bfloat16, 12),
    "h4_causal": (2, 9, 40, 4, 24, 8, 20, 16, jnp.float32, 0),
    "h16": (1, 6, 48, 16, 32, 16, 32, 16, jnp.float32, 30),
    "h4_causal_unused_last": (2, 9, 60, 4, 24, 8, 40, 16, jnp.float32, 10),
}
TOLERANCE = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _run(case, unused_last=False):
    batch, q_len, num_keys, heads, c_dim, r_dim, num_slots, block_n, dtype, q_offset = case
    rng = np.random.default_rng(sum(case[:8]))
    keys = jax.random.split(jax.random.key(case[0] + 10 * case[3]), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, c_dim + r_dim), jnp.float32).astype(dtype)
    latent = jax.random.normal(keys[1], (batch, num_keys, c_dim + r_dim), jnp.float32).astype(dtype)
    indices = causal_indices(rng, batch, q_len, num_keys, num_slots, q_offset)
    if q_len > 1:  # a query without valid slots; an index >= T counts as invalid like -1
        indices[0, 1] = -1
        indices[0, 1, -1] = num_keys + 5
    if unused_last:
        indices = -np.sort(-indices, axis=-1)  # keys >= 0 first, -1 last (query (0, 1)'s index >= T leads)
    indices = jnp.asarray(indices)
    d_out = jax.random.normal(keys[2], (batch, q_len, heads, c_dim), jnp.float32).astype(dtype)
    d_lse = jax.random.normal(keys[3], (batch, q_len, heads), jnp.float32)
    scale = (c_dim + r_dim) ** -0.5

    @jax.jit
    def both(q, latent, d_out, d_lse):
        results = []
        for fn in (sparse_mla_attention, sparse_mla_attention_reference):
            (out, lse), vjp = jax.vjp(
                lambda q_, l_: fn(q_, l_, indices, scale=scale, kv_lora_rank=c_dim, block_n=block_n), q, latent)
            results.append((out, lse, *vjp((d_out, d_lse))))
        return results

    return dict(q=q, latent=latent, indices=indices, d_lse=d_lse, scale=scale, dtype=dtype,
                results=both(q, latent, d_out, d_lse),
                lse_only=both(q, latent, jnp.zeros_like(d_out), d_lse)[0])


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request):
    return _run(CASES[request.param], unused_last=request.param.endswith("_unused_last"))


def test_output_and_lse_match_reference(run):
    kernel, reference = run["results"]
    tolerance = TOLERANCE[run["dtype"]]
    np.testing.assert_allclose(np.asarray(kernel[0], np.float32), np.asarray(reference[0], np.float32), **tolerance)
    np.testing.assert_allclose(kernel[1], reference[1], **tolerance)
    assert kernel[0].dtype == run["dtype"] and kernel[1].dtype == jnp.float32


def test_gradients_match_reference(run):
    """dq and dlatent, with cotangents on both out and lse (d lse / d logit = p is honoured)."""
    kernel, reference = run["results"]
    for got, want in zip(kernel[2:], reference[2:]):
        assert got.dtype == run["dtype"]
        scale = float(np.abs(np.asarray(want, np.float32)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want, np.float32) / scale,
                                   **TOLERANCE[run["dtype"]])
    # Key 0 is selected by (almost) every query, so its latent row sums one contribution per query.
    indices = np.asarray(run["indices"])
    assert int(np.sum(indices == 0)) >= indices.shape[0] * indices.shape[1] - 1
    assert np.abs(np.asarray(kernel[3][:, 0], np.float32)).max() > 0


def test_query_without_valid_slot_gives_zeros_and_finite_lse(run):
    kernel, _ = run["results"]
    out, lse, dq, dlatent = (np.asarray(x, np.float32) for x in kernel)
    assert np.isfinite(out).all() and np.isfinite(dq).all() and np.isfinite(dlatent).all()
    if run["indices"].shape[1] > 1:
        assert np.all(out[0, 1] == 0) and np.all(dq[0, 1] == 0)
        assert np.all(lse[0, 1] == np.float32(NEG_INF))


def test_lse_gradient_alone_is_p_weighted_keys(run):
    """With only an lse cotangent: dq[h] = scale * d_lse[h] * sum_n p[h, n] k_n (hand formula, numpy)."""
    q, latent, indices, d_lse = (np.asarray(run[name], np.float64) for name in ("q", "latent", "indices", "d_lse"))
    _, _, dq, _ = run["lse_only"]
    for b, s in [(0, 0), (q.shape[0] - 1, q.shape[1] - 1)]:  # (0, 1) may have no valid slot
        rows = latent[b, indices[b, s][indices[b, s] >= 0].astype(int)]
        logits = run["scale"] * q[b, s] @ rows.T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        want = run["scale"] * d_lse[b, s][:, None] * (p @ rows)
        np.testing.assert_allclose(np.asarray(dq[b, s], np.float64), want, **TOLERANCE[run["dtype"]])


def test_reference_matches_float64_loop():
    """The reference itself against a direct float64 numpy loop."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(1, 3, 2, 12))
    latent = rng.normal(size=(1, 7, 12))
    indices = np.array([[[0, -1, 4], [6, 5, 1], [-1, -1, -1]]], np.int32)
    out, lse = sparse_mla_attention_reference(jnp.asarray(q, jnp.float32), jnp.asarray(latent, jnp.float32),
                                              jnp.asarray(indices), scale=0.5, kv_lora_rank=8)
    for s in range(3):
        rows = latent[0, [i for i in indices[0, s] if i >= 0]]
        for h in range(2):
            if len(rows) == 0:
                assert np.all(np.asarray(out[0, s, h]) == 0) and lse[0, s, h] == NEG_INF
                continue
            logits = 0.5 * rows @ q[0, s, h]
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(out[0, s, h], (p / p.sum()) @ rows[:, :8], rtol=1e-5)
            np.testing.assert_allclose(lse[0, s, h], logits.max() + np.log(p.sum()), rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(q=jnp.zeros((1, 2, 4))), "q must have rank 4"),
    (dict(latent=jnp.zeros((1, 6, 40))), "latent.shape\\[-1\\]"),
    (dict(indices=jnp.zeros((1, 2, 3))), "indices must be an integer array"),
    (dict(indices=jnp.zeros((1, 3, 3), jnp.int32)), "indices.shape\\[:2\\]"),
    (dict(kv_lora_rank=48), "kv_lora_rank"),
    (dict(block_n=24), "block_n must be a power of two"),
    (dict(scale=-1.0), "scale must be a positive"),
    (dict(latent=jnp.zeros((1, 6, 48), jnp.bfloat16)), "latent.dtype"),
    (dict(bwd_query_chunk=0), "bwd_query_chunk"),
])
@pytest.mark.parametrize("entry", [sparse_mla_attention, sparse_mla_attention_with_target])
def test_bad_input_is_rejected_before_compiling(change, message, entry):
    args = dict(q=jnp.zeros((1, 2, 4, 48)), latent=jnp.zeros((1, 6, 48)), indices=jnp.zeros((1, 2, 3), jnp.int32),
                scale=0.1, kv_lora_rank=32, block_n=16)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        entry(args.pop("q"), args.pop("latent"), args.pop("indices"), **args)



@pytest.mark.parametrize("change, message", [
    (dict(row_gradients="sorted"), r"row_gradients='sorted' is invalid: must be one of \('scatter', 'atomic'\)"),
    (dict(row_gradients="atomic", platform="tpu"), r"row_gradients='atomic' is Triton's \(GPU\) only"),
])
@pytest.mark.parametrize("entry", [sparse_mla_attention, sparse_mla_attention_with_target])
def test_a_bad_row_gradient_mode_is_rejected_before_compiling(change, message, entry):
    with pytest.raises(ValueError, match=message):
        entry(jnp.zeros((1, 2, 4, 48)), jnp.zeros((1, 6, 48)), jnp.zeros((1, 2, 3), jnp.int32), scale=0.1,
              kv_lora_rank=32, block_n=16, **change)


def test_atomic_row_gradients_equal_the_scattered_ones():
    """The backward that adds each row gradient atomically into fp32 d(latent) (one call, invalid slots sent to a
    spare row) against the per-slot rows + scatter: key 0 is shared by every query, unused slots (-1 and an index
    >= T) come last, and queries stop early; fp32, so the two differ only in summation order."""
    batch, q_len, num_keys, heads, c_dim, r_dim, num_slots, block_n, dtype, q_offset = CASES["h4_causal_unused_last"]
    indices = causal_indices(np.random.default_rng(5), batch, q_len, num_keys, num_slots, q_offset)
    indices[0, 1] = -1
    indices[0, 1, 0] = num_keys + 5
    indices = jnp.asarray(-np.sort(-indices, axis=-1))
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, c_dim + r_dim))
    latent = jax.random.normal(keys[1], (batch, num_keys, c_dim + r_dim))
    cotangents = (jax.random.normal(keys[2], (batch, q_len, heads, c_dim)),
                  jax.random.normal(keys[3], (batch, q_len, heads)))

    def gradients(**options):
        _, vjp = jax.vjp(lambda q_, l_: sparse_mla_attention(q_, l_, indices, scale=0.2, kv_lora_rank=c_dim,
                                                             block_n=block_n, bwd_query_chunk=4, **options), q, latent)
        return vjp(cotangents)

    atomic, scattered = gradients(row_gradients="atomic"), gradients()
    for got, want in zip(atomic, scattered):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(atomic[1][:, 0]).max()) > 0


# A numerics test: TPU interpret mode's checks (test_tpu_kernels.py runs them) add nothing here but ~20 s.
@pytest.mark.parametrize("platform, row_gradients", [("gpu", "scatter"), ("gpu", "atomic"), ("tpu", "scatter")])
def test_bf16_row_gradients_sum_in_fp32(platform, row_gradients, plain_tpu_interpret):
    """bf16 kernels write each (query, slot) row gradient in bf16, but d(latent) sums them in fp32: with 128
    queries all selecting the same 16 rows, d(latent) stays within bf16 rounding of the fp32 reference on the
    same inputs: rms error 2.9e-3 of the rms (2.5e-3 with fp32 rows, as the atomic backward adds them; 1.3e-2
    when a chunk's rows sum in bf16)."""
    batch, q_len, num_keys, heads, c_dim, r_dim = 1, 128, 16, 4, 32, 16
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, c_dim + r_dim)).astype(jnp.bfloat16)
    latent = jax.random.normal(keys[1], (batch, num_keys, c_dim + r_dim)).astype(jnp.bfloat16)
    indices = jnp.broadcast_to(jnp.arange(num_keys, dtype=jnp.int32), (batch, q_len, num_keys))
    d_out = jax.random.normal(keys[2], (batch, q_len, heads, c_dim)).astype(jnp.bfloat16)
    d_lse = jax.random.normal(keys[3], (batch, q_len, heads))
    scale = (c_dim + r_dim) ** -0.5

    def d_latent(fn, q, latent, **kwargs):
        _, vjp = jax.vjp(lambda l_: fn(q, l_, indices, scale=scale, kv_lora_rank=c_dim, **kwargs), latent)
        return np.asarray(vjp((d_out.astype(q.dtype), d_lse))[0], np.float64)

    got = d_latent(sparse_mla_attention, q, latent, block_n=16, bwd_query_chunk=64, platform=platform,
                   row_gradients=row_gradients)
    want = d_latent(sparse_mla_attention_reference, q.astype(jnp.float32), latent.astype(jnp.float32))
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) < 6e-3


def test_the_default_backward_chunk_grows_with_the_keys():
    """Each backward step reads and writes the whole fp32 d(latent) [T, W]: by default the chunk doubles from 512
    (to 2048) until that is at most an eighth of the step's per-slot rows [chunk, N, W] in the latent's dtype."""
    from pallas_kernels.mla_layout import backward_query_chunk

    glm5 = {4096: 512, 65536: 512, 65537: 1024, 131072: 1024, 131073: 2048, 202752: 2048, 1 << 20: 2048}
    assert {t: backward_query_chunk(t, 2048, 2) for t in glm5} == glm5
    assert backward_query_chunk(131072, 2048, 4) == 512  # fp32 rows: twice the per-slot bytes
    assert backward_query_chunk(65536, 1024, 2) == 1024  # half the slots


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("entry", [sparse_mla_attention, sparse_mla_attention_with_target])
def test_a_call_without_a_backward_chunk_runs_its_backward_in_the_rules_chunks(platform, entry, monkeypatch):
    import pallas_kernels.sparse_mla as sparse_mla
    import pallas_kernels.tpu_sparse_mla as tpu_sparse_mla

    asked, chunks = [], []
    monkeypatch.setattr(sparse_mla, "backward_query_chunk", lambda *args: asked.append(args) or 4)
    module = tpu_sparse_mla if platform == "tpu" else sparse_mla
    chunked = module.chunked_backward
    monkeypatch.setattr(module, "chunked_backward",
                        lambda *a, chunk, **kw: chunks.append(chunk) or chunked(*a, chunk=chunk, **kw))
    q, latent = jnp.ones((1, 9, 2, 48), jnp.bfloat16), jnp.ones((1, 40, 48), jnp.bfloat16)
    indices = jnp.zeros((1, 9, 8), jnp.int32)
    loss = lambda q, latent: entry(q, latent, indices, scale=0.1, kv_lora_rank=32, block_n=16, interpret=True,  # noqa: E731
                                   platform=platform)[0].astype(jnp.float32).sum()
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, latent)
    assert asked == [(40, 8, 2)] and chunks == [4]
