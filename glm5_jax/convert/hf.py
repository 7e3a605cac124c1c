"""Hugging Face GlmMoeDsa checkpoints <-> the glm5_jax parameter pytree.

Two HF layouts are read: the released checkpoint layout (one tensor per expert:
`mlp.experts.{e}.gate_proj.weight`, plus the MTP layer `model.layers.{num_hidden_layers}.*`, which
transformers itself drops on load) and the in-memory transformers layout (`mlp.experts.gate_up_proj`
[E, 2F, D] and `mlp.experts.down_proj` [E, D, F]). Export writes the checkpoint layout (MTP included), which
`GlmMoeDsaForCausalLM.from_pretrained` loads. HF linear weights are [out, in]; ours are [in, out] with the
head axis split out (q_b_proj [Q, H, K], kv_b_proj [C, H, nope+P], o_proj [H, P, D], wq_b [Q, I, J]).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from glm5_jax.config import ModelConfig, model_config_from_hf
from glm5_jax.model.transformer import full_indexer_slots


class ConversionError(ValueError):
    """A checkpoint does not match the model configuration."""


def _attn_to_hf(attn: dict, config: ModelConfig, prefix: str, out: dict) -> None:
    h = config.num_attention_heads
    out[prefix + "q_a_proj.weight"] = attn["q_a_proj"]["kernel"].T
    out[prefix + "q_a_layernorm.weight"] = attn["q_a_norm"]["scale"]
    out[prefix + "q_b_proj.weight"] = attn["q_b_proj"]["kernel"].reshape(config.q_lora_rank, -1).T
    out[prefix + "kv_a_proj_with_mqa.weight"] = attn["kv_a_proj"]["kernel"].T
    out[prefix + "kv_a_layernorm.weight"] = attn["kv_a_norm"]["scale"]
    out[prefix + "kv_b_proj.weight"] = attn["kv_b_proj"]["kernel"].reshape(config.kv_lora_rank, -1).T
    out[prefix + "o_proj.weight"] = attn["o_proj"]["kernel"].reshape(h * config.v_head_dim, -1).T


def _indexer_to_hf(idx: dict, config: ModelConfig, prefix: str, out: dict) -> None:
    out[prefix + "wq_b.weight"] = idx["wq_b"]["kernel"].reshape(config.q_lora_rank, -1).T
    out[prefix + "wk.weight"] = idx["wk"]["kernel"].T
    out[prefix + "k_norm.weight"] = idx["k_norm"]["scale"]
    out[prefix + "k_norm.bias"] = idx["k_norm"]["bias"]
    out[prefix + "weights_proj.weight"] = idx["weights_proj"]["kernel"].T


def _mlp_to_hf(mlp: dict, prefix: str, out: dict) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{prefix}{name}.weight"] = mlp[name]["kernel"].T


def _moe_to_hf(moe: dict, prefix: str, out: dict, fused_experts: bool) -> None:
    out[prefix + "gate.weight"] = moe["router"]["kernel"].T
    out[prefix + "gate.e_score_correction_bias"] = moe["e_score_correction_bias"]
    ex = moe["experts"]
    if fused_experts:
        out[prefix + "experts.gate_up_proj"] = np.concatenate(
            [np.swapaxes(ex["gate_proj"], 1, 2), np.swapaxes(ex["up_proj"], 1, 2)], axis=1)
        out[prefix + "experts.down_proj"] = np.swapaxes(ex["down_proj"], 1, 2)
    else:
        for e in range(ex["gate_proj"].shape[0]):
            out[f"{prefix}experts.{e}.gate_proj.weight"] = ex["gate_proj"][e].T
            out[f"{prefix}experts.{e}.up_proj.weight"] = ex["up_proj"][e].T
            out[f"{prefix}experts.{e}.down_proj.weight"] = ex["down_proj"][e].T
    _mlp_to_hf(moe["shared_experts"], prefix + "shared_experts.", out)


def _layer_to_hf(layer: dict, indexer: dict | None, config: ModelConfig, prefix: str, out: dict,
                 fused_experts: bool) -> None:
    out[prefix + "input_layernorm.weight"] = layer["input_norm"]["scale"]
    out[prefix + "post_attention_layernorm.weight"] = layer["post_attn_norm"]["scale"]
    _attn_to_hf(layer["attn"], config, prefix + "self_attn.", out)
    if indexer is not None:
        _indexer_to_hf(indexer, config, prefix + "self_attn.indexer.", out)
    if "moe" in layer:
        _moe_to_hf(layer["moe"], prefix + "mlp.", out, fused_experts)
    else:
        _mlp_to_hf(layer["mlp"], prefix + "mlp.", out)


def _layer_slice(tree: dict, i: int) -> dict:
    return jax.tree.map(lambda a: a[i], tree)


def to_hf_state_dict(params: dict, config: ModelConfig, *, fused_experts: bool = False,
                     include_mtp: bool = True) -> dict[str, np.ndarray]:
    """Export to HF tensor names. `fused_experts=False` gives the released checkpoint layout."""
    params = jax.tree.map(np.asarray, params)
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": params["embed"]["embedding"]}
    slots = full_indexer_slots(config)
    for layer_idx in range(config.num_hidden_layers):
        dense = layer_idx < config.num_dense_layers
        stack = params["dense_layers"] if dense else params["moe_layers"]
        local = layer_idx if dense else layer_idx - config.num_dense_layers
        indexer = (_layer_slice(params["indexers"], slots[layer_idx])
                   if config.layer_indexer_types[layer_idx] == "full" else None)
        _layer_to_hf(_layer_slice(stack, local), indexer, config, f"model.layers.{layer_idx}.", out, fused_experts)
    out["model.norm.weight"] = params["final_norm"]["scale"]
    out["lm_head.weight"] = params["lm_head"]["kernel"].T
    if include_mtp and "mtp" in params:
        mtp = params["mtp"]
        prefix = f"model.layers.{config.num_hidden_layers}."
        layer = {k: v for k, v in mtp["layer"].items() if k != "indexer"}
        _layer_to_hf(layer, mtp["layer"]["indexer"], config, prefix, out, fused_experts)
        out[prefix + "enorm.weight"] = mtp["enorm"]["scale"]
        out[prefix + "hnorm.weight"] = mtp["hnorm"]["scale"]
        out[prefix + "eh_proj.weight"] = mtp["eh_proj"]["kernel"].T
        out[prefix + "shared_head.norm.weight"] = mtp["shared_head_norm"]["scale"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


class _Reader:
    """Pops tensors by name, checking shapes, so leftovers and mismatches are reported by name."""

    def __init__(self, state: dict):
        self.state = dict(state)

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.state:
            raise ConversionError(f"checkpoint tensor {name!r} is missing (expected shape {shape})")
        value = np.asarray(self.state.pop(name))
        if tuple(value.shape) != tuple(shape):
            raise ConversionError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, the config "
                                  f"needs {tuple(shape)}: the checkpoint belongs to another model shape")
        return value

    def has(self, name: str) -> bool:
        return name in self.state


def _attn_from_hf(r: _Reader, config: ModelConfig, p: str) -> dict:
    d, q, c, rr, h = (config.hidden_size, config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim,
                      config.num_attention_heads)
    kv_out = config.qk_nope_head_dim + config.v_head_dim
    return {
        "q_a_proj": {"kernel": r.take(p + "q_a_proj.weight", (q, d)).T},
        "q_a_norm": {"scale": r.take(p + "q_a_layernorm.weight", (q,))},
        "q_b_proj": {"kernel": r.take(p + "q_b_proj.weight", (h * config.qk_head_dim, q)).T.reshape(
            q, h, config.qk_head_dim)},
        "kv_a_proj": {"kernel": r.take(p + "kv_a_proj_with_mqa.weight", (c + rr, d)).T},
        "kv_a_norm": {"scale": r.take(p + "kv_a_layernorm.weight", (c,))},
        "kv_b_proj": {"kernel": r.take(p + "kv_b_proj.weight", (h * kv_out, c)).T.reshape(c, h, kv_out)},
        "o_proj": {"kernel": r.take(p + "o_proj.weight", (d, h * config.v_head_dim)).T.reshape(
            h, config.v_head_dim, d)},
    }


def _indexer_from_hf(r: _Reader, config: ModelConfig, p: str) -> dict:
    d, q, i, j = config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim
    return {
        "wq_b": {"kernel": r.take(p + "wq_b.weight", (i * j, q)).T.reshape(q, i, j)},
        "wk": {"kernel": r.take(p + "wk.weight", (j, d)).T},
        "k_norm": {"scale": r.take(p + "k_norm.weight", (j,)), "bias": r.take(p + "k_norm.bias", (j,))},
        "weights_proj": {"kernel": r.take(p + "weights_proj.weight", (i, d)).T},
    }


def _mlp_from_hf(r: _Reader, p: str, d: int, f: int) -> dict:
    return {
        "gate_proj": {"kernel": r.take(p + "gate_proj.weight", (f, d)).T},
        "up_proj": {"kernel": r.take(p + "up_proj.weight", (f, d)).T},
        "down_proj": {"kernel": r.take(p + "down_proj.weight", (d, f)).T},
    }


def _moe_from_hf(r: _Reader, config: ModelConfig, p: str) -> dict:
    d, e, f = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    if r.has(p + "experts.gate_up_proj"):
        gate_up = r.take(p + "experts.gate_up_proj", (e, 2 * f, d))
        experts = {"gate_proj": np.swapaxes(gate_up[:, :f], 1, 2), "up_proj": np.swapaxes(gate_up[:, f:], 1, 2),
                   "down_proj": np.swapaxes(r.take(p + "experts.down_proj", (e, d, f)), 1, 2)}
    else:
        per = [_mlp_from_hf(r, f"{p}experts.{k}.", d, f) for k in range(e)]
        experts = {n: np.stack([x[n]["kernel"] for x in per]) for n in ("gate_proj", "up_proj", "down_proj")}
    bias_name = p + "gate.e_score_correction_bias"
    return {
        "router": {"kernel": r.take(p + "gate.weight", (e, d)).T},
        "e_score_correction_bias": r.take(bias_name, (e,)) if r.has(bias_name) else np.zeros((e,), np.float32),
        "experts": experts,
        "shared_experts": _mlp_from_hf(r, p + "shared_experts.", d, f * config.n_shared_experts),
    }


def _layer_from_hf(r: _Reader, config: ModelConfig, layer_idx: int, moe: bool, with_indexer: bool):
    p = f"model.layers.{layer_idx}."
    d = config.hidden_size
    layer = {
        "input_norm": {"scale": r.take(p + "input_layernorm.weight", (d,))},
        "post_attn_norm": {"scale": r.take(p + "post_attention_layernorm.weight", (d,))},
        "attn": _attn_from_hf(r, config, p + "self_attn."),
    }
    if moe:
        layer["moe"] = _moe_from_hf(r, config, p + "mlp.")
    else:
        layer["mlp"] = _mlp_from_hf(r, p + "mlp.", d, config.intermediate_size)
    indexer = _indexer_from_hf(r, config, p + "self_attn.indexer.") if with_indexer else None
    return layer, indexer


def _stack(trees: list) -> dict:
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def from_hf_state_dict(state_dict: dict, config: ModelConfig, *, require_mtp: bool = False,
                       dtype=None) -> dict:
    """Import HF tensors (either layout). The MTP layer is read when present (or required)."""
    r = _Reader({k: (v.detach().cpu().float().numpy() if hasattr(v, "detach") else v)
                 for k, v in state_dict.items()})
    d, v = config.hidden_size, config.vocab_size
    dense, moe, indexers = [], [], []
    for layer_idx in range(config.num_hidden_layers):
        full = config.layer_indexer_types[layer_idx] == "full"
        layer, indexer = _layer_from_hf(r, config, layer_idx, layer_idx >= config.num_dense_layers, full)
        (dense if layer_idx < config.num_dense_layers else moe).append(layer)
        if full:
            indexers.append(indexer)
    params = {
        "embed": {"embedding": r.take("model.embed_tokens.weight", (v, d))},
        "indexers": _stack(indexers),
        "final_norm": {"scale": r.take("model.norm.weight", (d,))},
    }
    if dense:
        params["dense_layers"] = _stack(dense)
    if moe:
        params["moe_layers"] = _stack(moe)
    if config.tie_word_embeddings and not r.has("lm_head.weight"):
        params["lm_head"] = {"kernel": params["embed"]["embedding"].T.copy()}
    else:
        params["lm_head"] = {"kernel": r.take("lm_head.weight", (v, d)).T}
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    if config.num_nextn_predict_layers and (require_mtp or r.has(mtp_prefix + "eh_proj.weight")):
        layer, indexer = _layer_from_hf(r, config, config.num_hidden_layers, True, True)
        layer["indexer"] = indexer
        params["mtp"] = {
            "enorm": {"scale": r.take(mtp_prefix + "enorm.weight", (d,))},
            "hnorm": {"scale": r.take(mtp_prefix + "hnorm.weight", (d,))},
            "eh_proj": {"kernel": r.take(mtp_prefix + "eh_proj.weight", (d, 2 * d)).T},
            "layer": layer,
            "shared_head_norm": {"scale": r.take(mtp_prefix + "shared_head.norm.weight", (d,))},
        }
    # Copies of the embedding / head stored with the MTP layer by some exporters carry no new weights.
    leftovers = [k for k in r.state if not k.startswith(mtp_prefix + ("embed_tokens", "shared_head.head"))]
    if leftovers:
        raise ConversionError(f"checkpoint has {len(leftovers)} tensors the config does not use, e.g. "
                              f"{sorted(leftovers)[:3]}: check num_hidden_layers / indexer_types")
    cast = (lambda a: np.ascontiguousarray(a, dtype=dtype)) if dtype is not None else np.ascontiguousarray
    return jax.tree.map(cast, params)


def _require_safetensors():
    try:
        import safetensors.numpy  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("reading/writing safetensors checkpoints needs `pip install safetensors` "
                          "(included in the [test] extra)") from err


def hf_config_dict(config: ModelConfig) -> dict:
    """A `config.json` for GlmMoeDsaForCausalLM describing this model."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        **{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "index_n_heads",
            "index_head_dim", "index_topk", "rms_norm_eps", "max_position_embeddings", "hidden_act",
            "tie_word_embeddings", "initializer_range", "num_nextn_predict_layers")},
        "num_key_value_heads": config.num_attention_heads,
        "indexer_types": list(config.layer_indexer_types),
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "torch_dtype": "float32",
    }


def save_hf_checkpoint(params: dict, config: ModelConfig, path: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` in the released checkpoint layout (MTP layer included)."""
    _require_safetensors()
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_state_dict(params, config)
    if any(t.dtype == np.dtype("bfloat16") for t in tensors.values()):
        tensors = {k: t.astype(np.float32) for k, t in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
    return path


def load_hf_checkpoint(path: str | Path, config: ModelConfig | None = None, dtype=None) -> tuple[dict, ModelConfig]:
    """Read a safetensors directory (all `*.safetensors` shards); the config comes from its config.json
    unless given. Returns (params, config)."""
    _require_safetensors()
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"checkpoint path {str(path)!r} is not a directory")
    if config is None:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConversionError(f"{str(config_file)!r} not found: pass a ModelConfig or add config.json")
        config = model_config_from_hf(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"no *.safetensors files in {str(path)!r}")
    state = {}
    for file in files:
        # framework="flax" reads bfloat16 tensors too (numpy has no native bf16).
        with safe_open(str(file), framework="flax") as f:
            for key in f.keys():
                state[key] = np.asarray(f.get_tensor(key).astype("float32"))
    return from_hf_state_dict(state, config, dtype=dtype), config
