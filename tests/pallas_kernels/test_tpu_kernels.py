"""The Mosaic TPU kernels (platform="tpu") in TPU interpret mode (DMAs, semaphores, SMEM) against the jnp
references: sparse MLA forward and gradients, the sparse and dense KL targets, the forward with the sparse
target fused in, indexer scores and top-k, and the platform keyword. Shapes are tiny: TPU interpret mode runs
every DMA through a host callback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    NEG_INF,
    dense_attention_target,
    indexer_scores,
    indexer_topk,
    sparse_attention_target,
    sparse_mla_attention,
    sparse_mla_attention_with_target,
)
from pallas_kernels.mla_layout import MlaLayout
from pallas_kernels.reference import (
    dense_attention_target_reference,
    indexer_scores_reference,
    sparse_attention_target_reference,
    sparse_mla_attention_reference,
    sparse_mla_attention_with_target_reference,
)
from pallas_kernels.tpu_sparse_mla import TpuSizes, latent_rows, unpack_rows

TPU = dict(platform="tpu", interpret=True)


def _indices(seed, batch, q_len, num_keys, num_slots):
    """Distinct valid keys per query, key 0 in every query (a shared row), the rest -1; query (0, 1), when
    there is one, has no valid slot but an index >= T (invalid like -1)."""
    rng = np.random.default_rng(seed)
    indices = np.full((batch, q_len, num_slots), -1, np.int32)
    for b in range(batch):
        for s in range(q_len):
            count = int(rng.integers(1, min(num_slots, num_keys) + 1))
            keys = np.concatenate([[0], rng.choice(np.arange(1, num_keys), size=count - 1, replace=False)])
            indices[b, s, rng.choice(num_slots, size=count, replace=False)] = keys
    if q_len > 1:
        indices[0, 1] = -1
        indices[0, 1, -1] = num_keys + 3
    return jnp.asarray(indices)


# (batch, S, T, H, C, R, N, block_n, dtype, bwd_query_chunk): N not a multiple of block_n, S = 1, H = 1 and 4,
# more queries than one backward chunk (padded last chunk). "_unused_last": each query's valid slots first and
# its unused ones (-1) last, as the indexer's top-k returns them, so the programs skip whole trailing blocks.
CASES = {
    "h4_f32": (2, 3, 40, 4, 24, 8, 20, 16, jnp.float32, 2),
    "h1_s1_bf16": (1, 1, 20, 1, 32, 16, 5, 16, jnp.bfloat16, 256),
    "h4_f32_unused_last": (2, 5, 60, 4, 24, 8, 40, 16, jnp.float32, 2),
}
TOLERANCE = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=3e-2, atol=3e-2)}


# The two 4-head cases take 10-13 s of TPU interpret mode each: slow tier; the one-head bf16 case stays in the
# inner loop.
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name.startswith("h4") else name
                                        for name in sorted(CASES)])
def sparse_case(request):
    batch, q_len, num_keys, heads, c_dim, r_dim, num_slots, block_n, dtype, chunk = CASES[request.param]
    keys = jax.random.split(jax.random.key(heads), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, c_dim + r_dim)).astype(dtype)
    latent = jax.random.normal(keys[1], (batch, num_keys, c_dim + r_dim)).astype(dtype)
    indices = _indices(heads, batch, q_len, num_keys, num_slots)
    if request.param.endswith("_unused_last"):
        indices = -jnp.sort(-indices, axis=-1)  # keys >= 0 first, -1 last (query (0, 1)'s index >= T leads)
    d_out = jax.random.normal(keys[2], (batch, q_len, heads, c_dim)).astype(dtype)
    d_lse = jax.random.normal(keys[3], (batch, q_len, heads))
    scale = (c_dim + r_dim) ** -0.5

    @jax.jit
    def run(q, latent):
        results = []
        for fn, extra in ((sparse_mla_attention, dict(bwd_query_chunk=chunk, **TPU)),
                          (sparse_mla_attention_reference, {})):
            (out, lse), vjp = jax.vjp(lambda q_, l_: fn(q_, l_, indices, scale=scale, kv_lora_rank=c_dim,
                                                        block_n=block_n, **extra), q, latent)
            results.append((out, lse, *vjp((d_out, d_lse))))
        target = sparse_attention_target(q, latent, indices, results[1][1], scale=scale, block_n=block_n, **TPU)
        # The two-kernel composition the model ran before the fused forward: the target from the kernel's lse.
        fused = {"pair": sparse_attention_target(q, latent, indices, results[0][1], scale=scale, block_n=block_n,
                                                 **TPU)}
        for name, fn, extra in (("kernel", sparse_mla_attention_with_target, dict(bwd_query_chunk=chunk, **TPU)),
                                ("reference", sparse_mla_attention_with_target_reference, {})):
            (out, lse, fused_target), vjp = jax.vjp(
                lambda q_, l_: fn(q_, l_, indices, scale=scale, kv_lora_rank=c_dim, block_n=block_n, **extra),
                q, latent)
            # A cotangent on the target too: it must change nothing (the target is a constant).
            fused[name] = (out, lse, fused_target, *vjp((d_out, d_lse, jnp.ones_like(fused_target))))
        return results, target, fused

    (kernel, reference), target, fused = run(q, latent)
    return dict(q=q, latent=latent, indices=indices, scale=scale, dtype=dtype, kernel=kernel,
                reference=reference, target=target, fused=fused)


def test_sparse_mla_forward_and_gradients_match_reference(sparse_case):
    """out, lse, and dq / d latent of a loss on both out and lse (d lse honoured)."""
    tolerance = TOLERANCE[sparse_case["dtype"]]
    kernel, reference = sparse_case["kernel"], sparse_case["reference"]
    for name, got, want in zip(("out", "lse", "dq", "dlatent"), kernel, reference):
        assert got.dtype == want.dtype, name
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        norm = 1.0 if name in ("out", "lse") else float(np.abs(want).max())
        np.testing.assert_allclose(got / norm, want / norm, err_msg=name, **tolerance)
    assert np.abs(np.asarray(kernel[3][:, 0], np.float32)).max() > 0  # key 0: one contribution per query


def test_sparse_mla_query_without_valid_slot(sparse_case):
    out, lse, dq, dlatent = (np.asarray(x, np.float32) for x in sparse_case["kernel"])
    assert np.isfinite(out).all() and np.isfinite(dq).all() and np.isfinite(dlatent).all()
    if sparse_case["indices"].shape[1] > 1:
        assert np.all(out[0, 1] == 0) and np.all(dq[0, 1] == 0) and np.all(lse[0, 1] == np.float32(NEG_INF))
        assert np.all(np.asarray(sparse_case["target"][0, 1]) == 0)


def test_sparse_target_matches_reference(sparse_case):
    want = sparse_attention_target_reference(sparse_case["q"], sparse_case["latent"], sparse_case["indices"],
                                             sparse_case["reference"][1], scale=sparse_case["scale"])
    np.testing.assert_allclose(sparse_case["target"], want, **TOLERANCE[sparse_case["dtype"]])
    assert np.all(np.asarray(sparse_case["target"])[np.asarray(sparse_case["indices"]) < 0] == 0)



def test_fused_target_forward_matches_the_two_kernels_and_reference(sparse_case):
    """sparse_mla_attention_with_target: out and lse are sparse_mla_attention's, the target that of
    sparse_attention_target from its lse and of the jnp reference (padded heads: H 1 and 4 pad to 16; slots
    -1 and >= T; a query without valid slots), dq and d latent sparse_mla_attention's, whatever the target's
    cotangent."""
    tolerance = TOLERANCE[sparse_case["dtype"]]
    kernel, fused = sparse_case["kernel"], sparse_case["fused"]["kernel"]
    out, lse, target, dq, dlatent = fused
    for name, got, want in (("out", out, kernel[0]), ("lse", lse, kernel[1]), ("dq", dq, kernel[2]),
                            ("dlatent", dlatent, kernel[3])):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)
    assert target.dtype == jnp.float32 and target.shape == sparse_case["indices"].shape
    np.testing.assert_allclose(target, sparse_case["fused"]["pair"], **tolerance)
    reference = sparse_case["fused"]["reference"]
    for name, got, want in zip(("out", "lse", "target", "dq", "dlatent"), fused, reference):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        norm = 1.0 if name in ("out", "lse", "target") else float(np.abs(want).max())
        np.testing.assert_allclose(got / norm, want / norm, err_msg=name, **tolerance)
    indices = np.asarray(sparse_case["indices"])
    invalid = (indices < 0) | (indices >= sparse_case["latent"].shape[1])
    assert np.all(np.asarray(target)[invalid] == 0)
    row_sums = np.asarray(target).sum(-1)
    has_valid = (~invalid).any(-1)
    np.testing.assert_allclose(row_sums[has_valid], 1.0, rtol=1e-5)
    assert np.all(row_sums[~has_valid] == 0)


@pytest.mark.parametrize("dtype, stored", [(jnp.bfloat16, (jnp.uint32, 384)), (jnp.float32, (jnp.float32, 640))])
def test_gathered_rows_layout_round_trips(dtype, stored):
    """GLM-5 rows (576 wide): bf16 packed two columns per uint32 word (384 words: no (2, 128) tile padding in
    HBM), fp32 lane padded to 640; unpacked, both are the zero-padded [T, 640] rows bit for bit."""
    latent = jax.random.normal(jax.random.key(0), (1, 5, 576)).astype(dtype)
    sizes = TpuSizes.of(MlaLayout(heads=64, latent_dim=512, rope_dim=64, num_slots=16, block_n=16))
    rows = latent_rows(latent, sizes)
    assert (rows.dtype, rows.shape) == (stored[0], (1, 5, 1, stored[1]))
    unpacked = unpack_rows(rows[0, :, 0], sizes.width, dtype)
    assert unpacked.dtype == dtype
    np.testing.assert_array_equal(np.asarray(unpacked, np.float32),
                                  np.pad(np.asarray(latent[0], np.float32), ((0, 0), (0, 64))))

def _segmented(q_len, num_keys, q_offset):
    """Two segments per batch row, plus a query whose segment has no key."""
    k_seg = np.ones((2, num_keys), np.int32)
    k_seg[:, num_keys // 2:] = 2
    q_seg = np.broadcast_to(np.where(q_offset + np.arange(q_len) < num_keys // 2, 1, 2), (2, q_len)).copy()
    q_seg[1, 0] = 7
    return dict(q_segment_ids=jnp.asarray(q_seg), k_segment_ids=jnp.asarray(k_seg), q_offset=q_offset)


def test_indexer_scores_and_topk_exact():
    """Dyadic inputs (small integers, J = 16, quarter weights) make every score exact in fp32: the scores
    equal the reference bit for bit and the indices are those of lax.top_k on the reference (exact ties
    resolved lowest index first). Causal + segment masks, q_offset, T not a multiple of the key block."""
    rng = np.random.default_rng(0)
    q_len, num_keys, topk = 11, 37, 8
    q = jnp.asarray(rng.integers(-2, 3, (2, q_len, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.integers(-2, 3, (2, num_keys, 16)), jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, (2, q_len, 4)) / 4, jnp.float32)
    masks = _segmented(q_len, num_keys, q_offset=26)
    scores, (indices, values) = jax.jit(lambda q, k, w: (
        indexer_scores(q, k, w, block_t=16, **masks, **TPU),
        indexer_topk(q, k, w, topk=topk, query_chunk=4, block_t=16, **masks, **TPU)))(q, k, w)
    reference = indexer_scores_reference(q, k, w, **masks)
    np.testing.assert_array_equal(scores, reference)
    want_values, want_indices = jax.lax.top_k(reference, topk)
    np.testing.assert_array_equal(indices, np.where(want_values > NEG_INF / 2, want_indices, -1))
    np.testing.assert_array_equal(values, want_values)
    assert np.all(np.asarray(indices[1, 0]) == -1)  # segment 7 has no key
    assert any(len(set(row)) < len(row) for row in np.asarray(values).reshape(-1, topk))  # real ties


def test_dense_target_matches_reference():
    """Segments, q_offset, T not a multiple of the key block, 3 heads, a query without visible keys."""
    keys = jax.random.split(jax.random.key(1), 2)
    q_len, num_keys = 6, 21
    q = jax.random.normal(keys[0], (2, q_len, 3, 40))
    latent = jax.random.normal(keys[1], (2, num_keys, 40))
    masks = _segmented(q_len, num_keys, q_offset=15)
    target = jax.jit(lambda q, l: dense_attention_target(q, l, scale=0.15, block_t=16, **masks, **TPU))(q, latent)
    np.testing.assert_allclose(target, dense_attention_target_reference(q, latent, scale=0.15, **masks),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(target[1, 0]) == 0)


def test_platform_keyword(monkeypatch):
    """Bad values are refused with the valid ones named; None picks the TPU kernels on a TPU backend (a
    compiled call there now lowers for Mosaic instead of raising)."""
    q, latent, indices = jnp.zeros((1, 2, 4, 48)), jnp.zeros((1, 6, 48)), jnp.zeros((1, 2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"platform must be one of \('gpu', 'tpu'\) or None; got 'cuda'"):
        sparse_mla_attention(q, latent, indices, scale=0.1, kv_lora_rank=32, platform="cuda")
    with pytest.raises(ValueError, match="platform must be one of"):
        dense_attention_target(q, latent, scale=0.1, platform="TPU")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    fn = lambda q, l, i: sparse_mla_attention(q, l, i, scale=0.1, kv_lora_rank=32, block_n=16, interpret=False)
    assert "tpu_custom_call" in jax.export.export(jax.jit(fn), platforms=["tpu"])(q, latent, indices).mlir_module()


def test_row_block_counts_stop_at_each_querys_last_valid_block():
    """The blocks a program visits: up to its last block with a valid slot, wherever the unused slots are; the
    "_unused_last" case above checks the values and gradients of programs that stop early."""
    from pallas_kernels.tpu_sparse_mla import row_block_counts

    indices = np.full((1, 4, 3, 2), -1, np.int32)  # 4 queries, 3 blocks of 2 slots, T = 10
    indices[0, 0, 0, 0] = 7  # block 0 only -> 1
    indices[0, 1, 2, 1] = 3  # a valid slot in the last block -> 3
    indices[0, 2, 1] = [10, 4]  # >= T is unused; 4 in block 1 -> 2
    # query 3: no valid slot -> 0
    counts = np.asarray(row_block_counts(jnp.asarray(indices), 10))
    assert counts.shape == (1, 4, 1, 1) and counts.dtype == np.int32
    np.testing.assert_array_equal(counts[0, :, 0, 0], [1, 3, 2, 0])


def test_plain_interpret_mode_gives_the_tpu_interpret_modes_values(monkeypatch):
    """PALLAS_TPU_INTERPRET_CHECKS=0 (the whole-model tests' `plain_tpu_interpret` fixture) runs the Mosaic
    kernels as one XLA program instead of a host callback per operation: the same forward and gradients."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels._common import TPU_INTERPRET_CHECKS, tpu_interpret

    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (1, 8, 1, 40))
    latent = jax.random.normal(keys[1], (1, 8, 40))
    indices = jax.random.randint(keys[2], (1, 8, 16), -1, 8)

    def run():  # traced anew each call: the mode is read while tracing
        loss = lambda q, latent: jnp.sum(sparse_mla_attention(q, latent, indices, scale=0.2, kv_lora_rank=32,  # noqa: E731
                                                              **TPU)[0] ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(q, latent)

    assert isinstance(tpu_interpret(True), pltpu.InterpretParams) and tpu_interpret(False) is False
    checked = run()
    monkeypatch.setenv(TPU_INTERPRET_CHECKS, "0")
    assert tpu_interpret(True) is True
    for got, want in zip(jax.tree.leaves(run()), jax.tree.leaves(checked)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
