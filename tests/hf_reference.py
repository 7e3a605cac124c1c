"""Build a Hugging Face GlmMoeDsaForCausalLM with random weights matching a ModelConfig (tests only)."""

from __future__ import annotations

import numpy as np
import torch

from glm5_jax.config import ModelConfig
from glm5_jax.convert.hf import hf_config_dict


def build_hf_model(config: ModelConfig, seed: int):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    kwargs = {k: v for k, v in hf_config_dict(config).items() if k not in ("architectures", "model_type",
                                                                          "torch_dtype")}
    hf_config = GlmMoeDsaConfig(**kwargs)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(hf_config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Non-trivial norms, biases and correction biases, so a dropped or misplaced one shows up.
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("k_norm.bias"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=generator))
    return model


def hf_topk_indices(model, tokens: np.ndarray):
    """Run HF and capture each layer's top-k indices [L, B, S, N] and the logits."""
    captured = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, i, o: captured.append(o[2].clone()))
             for layer in model.model.layers]
    with torch.no_grad():
        logits = model(torch.from_numpy(np.asarray(tokens)).long()).logits
    for h in hooks:
        h.remove()
    return logits.numpy(), torch.stack(captured).numpy()


def hf_index_scores(model, tokens: np.ndarray):
    """The masked index scores [B, S, T] of every full indexer layer (for tie checks), via forward hooks."""
    scores = []

    def hook(module, args, kwargs, _output):
        hidden, q_resid, position_embeddings, mask = args[:4]
        b, s, _ = hidden.shape
        q = module.wq_b(q_resid).view(b, s, module.n_heads, module.head_dim)
        q_rot, q_pass = torch.split(q, [module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim], -1)
        k = module.k_norm(module.wk(hidden)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim], -1)
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

        cos, sin = position_embeddings
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], -1)
        k = torch.cat([k_rot, k_pass], -1).squeeze(2)
        logits = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale)
        w = module.weights_proj(hidden).float() * module.n_heads**-0.5
        index = torch.matmul(w.unsqueeze(-2), logits).squeeze(-2)
        scores.append((index + mask).numpy())

    hooks = [layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True)
             for layer in model.model.layers if layer.self_attn.indexer is not None]
    with torch.no_grad():
        model(torch.from_numpy(np.asarray(tokens)).long())
    for h in hooks:
        h.remove()
    return scores


def has_boundary_ties(scores_per_layer, topk: int, rel_gap: float = 1e-4) -> bool:
    """True when some query's k-th and (k+1)-th visible scores are (nearly) equal."""
    for scores in scores_per_layer:
        sorted_scores = -np.sort(-scores, axis=-1)
        if sorted_scores.shape[-1] <= topk:
            continue
        kth, next_ = sorted_scores[..., topk - 1], sorted_scores[..., topk]
        visible = next_ > -1e30  # more than k visible keys
        scale = np.maximum(np.abs(kth), 1e-6)
        if np.any(visible & (np.abs(kth - next_) <= rel_gap * scale)):
            return True
    return False
