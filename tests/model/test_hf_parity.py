"""Forward parity with Hugging Face GlmMoeDsaForCausalLM (the executable reference), weights moved through
the converter. Sequences are longer than index_topk so the indexer prunes; cases with near-ties at the
k-th index score are reseeded (torch.topk and jax.lax.top_k break ties differently)."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_reference import build_hf_model, has_boundary_ties, hf_index_scores, hf_topk_indices  # noqa: E402

from glm5_jax.config import ModelConfig  # noqa: E402
from glm5_jax.convert.hf import from_hf_state_dict  # noqa: E402
from glm5_jax.model.transformer import FORWARD_STATIC_ARGNAMES, forward as pure_forward  # noqa: E402

forward = jax.jit(pure_forward, static_argnames=FORWARD_STATIC_ARGNAMES)

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=8, num_experts_per_tok=2, index_n_heads=8, index_head_dim=16,
            num_nextn_predict_layers=0, mtp_num_steps=0, compute_dtype="float32")

CASES = {
    # groups: n_group 4 with topk_group 2; 1 dense + 2 MoE layers.
    "grouped_routing": dict(num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2,
                            index_topk=8, seq=24),
    # IndexShare: shared layers reuse the previous full layer's top-k.
    "index_share": dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1, index_topk=6,
                        indexer_types=("full", "shared", "full", "shared"), seq=20),
    # All-MoE, more heads, wider top-k, odd shapes.
    "all_moe": dict(num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=6, n_routed_experts=12,
                    num_experts_per_tok=3, n_group=3, topk_group=3, index_topk=12, qk_rope_head_dim=12,
                    index_head_dim=24, seq=30),
}


def _tie_free_case(config: ModelConfig, seq: int):
    for seed in range(20):
        model = build_hf_model(config, seed)
        tokens = np.random.RandomState(seed).randint(0, config.vocab_size, (2, seq))
        if not has_boundary_ties(hf_index_scores(model, tokens), config.index_topk):
            return model, tokens
    raise AssertionError("no tie-free seed found in 20 tries")


# The inner loop (not slow) keeps one case; the full suite runs all three.
@pytest.fixture(scope="module", params=[pytest.param(name, marks=[] if name == "grouped_routing" else [pytest.mark.slow])
                                        for name in sorted(CASES)])
def case(request):
    spec = dict(CASES[request.param])
    seq = spec.pop("seq")
    config = ModelConfig(**{**BASE, **spec}).validate()
    assert seq > config.index_topk
    model, tokens = _tie_free_case(config, seq)
    hf_logits, hf_topk = hf_topk_indices(model, tokens)
    params = jax.tree.map(jnp.asarray, from_hf_state_dict(model.state_dict(), config))
    return config, params, tokens, hf_logits, hf_topk


# Each backend against HF in every case; that the backends agree with each other on every combination is
# test_model.py's job. Both forwards collect routing, so the top-k test reuses the sparse one's compile.
BACKENDS = [("dense", "reference"), ("sparse", "ragged")]


def _forward(case, attention_backend, moe_backend):
    config, params, tokens, *_ = case
    config = dataclasses.replace(config, attention_backend=attention_backend, moe_backend=moe_backend)
    return forward(params, jnp.asarray(tokens), config=config, collect_routing=True)


@pytest.mark.parametrize("attention_backend, moe_backend", BACKENDS)
def test_logits_match_hf(case, attention_backend, moe_backend):
    out = _forward(case, attention_backend, moe_backend)
    np.testing.assert_allclose(np.asarray(out.logits), case[3], atol=1e-4, rtol=0)


def test_topk_sets_match_hf_on_every_causal_position(case):
    config, params, tokens, _, hf_topk = case
    ours = np.asarray(_forward(case, "sparse", "ragged").aux["topk"])
    assert ours.shape == hf_topk.shape
    layers, batch, seq, _ = ours.shape
    pruned_rows = 0
    for layer in range(layers):
        for b in range(batch):
            for s in range(seq):
                theirs = {int(i) for i in hf_topk[layer, b, s] if i <= s}  # HF also lists masked keys
                mine = {int(i) for i in ours[layer, b, s] if i >= 0}
                assert mine == theirs, (layer, b, s)
                pruned_rows += s + 1 > config.index_topk
    assert pruned_rows > 0  # the indexer really pruned somewhere
