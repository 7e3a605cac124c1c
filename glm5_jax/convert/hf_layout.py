"""The one table that maps every parameter leaf to the Hugging Face tensors it is made of.

Each leaf gets a `LeafRecipe`: its leading stacked axes (layers, and experts for routed-expert weights), the
HF tensor name of each stacked item, and how one item converts between layouts. HF linear weights are
[out, in]; ours are [in, out] with the head axis split out (q_b_proj [Q, H, K], kv_b_proj [C, H, nope+V],
wq_b [Q, I, J]), except o_proj, [out, in] as HF has it with the input split ([D, H, V]). Two HF layouts are
read: the released checkpoint layout (one tensor per expert, `mlp.experts.{e}.gate_proj.weight`, plus the MTP
layer `model.layers.{num_hidden_layers}.*`) and transformers' in-memory layout (`mlp.experts.gate_up_proj`
[E, 2F, D], `mlp.experts.down_proj` [E, D, F]).
Export always writes the released layout.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterator

import numpy as np

from glm5_jax.config import ModelConfig
Index = tuple[int, ...]
NameFn = Callable[[Index], str]


class ConversionError(ValueError):
    """A checkpoint does not match the model configuration."""


@dataclasses.dataclass(frozen=True)
class LeafRecipe:
    """One parameter leaf [*stack, *item_shape] as HF tensors, one per index of the stacked axes.

    kind "id": the HF tensor of shape `hf_shape` is the item (its last axis split, for o_proj); "T": the HF
    tensor [out, in] of shape `hf_shape` is the item transposed (and its `out` axis split, for per-head
    kernels); "fused_gate" / "fused_up" / "fused_down": one half (or the down projection) of transformers'
    fused expert tensors of a whole layer.
    """

    stack: Index
    item_shape: Index
    name: NameFn
    kind: str
    hf_shape: Index
    default: float | None = None  # value of a tensor older checkpoints may omit (None: required)

    @property
    def shape(self) -> Index:
        return self.stack + self.item_shape

    def names(self) -> Iterator[tuple[Index, str]]:
        for index in itertools.product(*(range(n) for n in self.stack)):
            yield index, self.name(index)

    def to_ours(self, hf: np.ndarray) -> np.ndarray:
        if self.kind == "id":
            return hf.reshape(self.item_shape)
        if self.kind == "T":
            return hf.T.reshape(self.item_shape)
        if self.kind == "fused_down":
            return np.swapaxes(hf, 1, 2)
        f = hf.shape[1] // 2
        return np.swapaxes(hf[:, :f] if self.kind == "fused_gate" else hf[:, f:], 1, 2)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        if self.kind == "id":
            return ours.reshape(self.hf_shape)
        if self.kind == "T":
            return ours.reshape(self.hf_shape[::-1]).T
        raise ConversionError(f"export writes the per-expert layout, not {self.kind!r}")


def _leaf(stack: Index, item_shape: Index, name: NameFn, kind: str = "T", hf_shape: Index | None = None,
          default: float | None = None) -> LeafRecipe:
    item_shape = tuple(item_shape)
    if hf_shape is None:
        hf_shape = item_shape[::-1] if kind == "T" else item_shape
    return LeafRecipe(tuple(stack), item_shape, name, kind, tuple(hf_shape), default)


def _named(prefix: NameFn, suffix: str) -> NameFn:
    return lambda index: prefix(index) + suffix


def _attention(config: ModelConfig, stack: Index, p: NameFn) -> dict:
    d, q, c, r, h = (config.hidden_size, config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim,
                     config.num_attention_heads)
    k, v, kv_out = config.qk_head_dim, config.v_head_dim, config.qk_nope_head_dim + config.v_head_dim
    return {
        "q_a_proj": {"kernel": _leaf(stack, (d, q), _named(p, "q_a_proj.weight"))},
        "q_a_norm": {"scale": _leaf(stack, (q,), _named(p, "q_a_layernorm.weight"), "id")},
        "q_b_proj": {"kernel": _leaf(stack, (q, h, k), _named(p, "q_b_proj.weight"), hf_shape=(h * k, q))},
        "kv_a_proj": {"kernel": _leaf(stack, (d, c + r), _named(p, "kv_a_proj_with_mqa.weight"))},
        "kv_a_norm": {"scale": _leaf(stack, (c,), _named(p, "kv_a_layernorm.weight"), "id")},
        "kv_b_proj": {"kernel": _leaf(stack, (c, h, kv_out), _named(p, "kv_b_proj.weight"),
                                      hf_shape=(h * kv_out, c))},
        "o_proj": {"kernel": _leaf(stack, (d, h, v), _named(p, "o_proj.weight"), "id", hf_shape=(d, h * v))},
    }


def _indexer(config: ModelConfig, stack: Index, p: NameFn) -> dict:
    d, q, i, j = config.hidden_size, config.q_lora_rank, config.index_n_heads, config.index_head_dim
    return {
        "wq_b": {"kernel": _leaf(stack, (q, i, j), _named(p, "wq_b.weight"), hf_shape=(i * j, q))},
        "wk": {"kernel": _leaf(stack, (d, j), _named(p, "wk.weight"))},
        "k_norm": {"scale": _leaf(stack, (j,), _named(p, "k_norm.weight"), "id"),
                   "bias": _leaf(stack, (j,), _named(p, "k_norm.bias"), "id")},
        "weights_proj": {"kernel": _leaf(stack, (d, i), _named(p, "weights_proj.weight"))},
    }


def _mlp(stack: Index, p: NameFn, d: int, f: int) -> dict:
    return {"gate_proj": {"kernel": _leaf(stack, (d, f), _named(p, "gate_proj.weight"))},
            "up_proj": {"kernel": _leaf(stack, (d, f), _named(p, "up_proj.weight"))},
            "down_proj": {"kernel": _leaf(stack, (f, d), _named(p, "down_proj.weight"))}}


def _experts(config: ModelConfig, stack: Index, p: NameFn, fused: bool) -> dict:
    d, e, f = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    if fused:
        return {"gate_proj": _leaf(stack, (e, d, f), _named(p, "experts.gate_up_proj"), "fused_gate", (e, 2 * f, d)),
                "up_proj": _leaf(stack, (e, d, f), _named(p, "experts.gate_up_proj"), "fused_up", (e, 2 * f, d)),
                "down_proj": _leaf(stack, (e, f, d), _named(p, "experts.down_proj"), "fused_down", (e, d, f))}
    per_expert = lambda index: p(index[:-1]) + f"experts.{index[-1]}."  # noqa: E731
    return {name: leaf["kernel"] for name, leaf in _mlp(stack + (e,), per_expert, d, f).items()}


def _layer(config: ModelConfig, stack: Index, p: NameFn, *, moe: bool, fused: bool) -> dict:
    d = config.hidden_size
    layer = {
        "input_norm": {"scale": _leaf(stack, (d,), _named(p, "input_layernorm.weight"), "id")},
        "post_attn_norm": {"scale": _leaf(stack, (d,), _named(p, "post_attention_layernorm.weight"), "id")},
        "attn": _attention(config, stack, _named(p, "self_attn.")),
    }
    if not moe:
        layer["mlp"] = _mlp(stack, _named(p, "mlp."), d, config.intermediate_size)
        return layer
    mlp = _named(p, "mlp.")
    e = config.n_routed_experts
    layer["moe"] = {
        "router": {"kernel": _leaf(stack, (d, e), _named(mlp, "gate.weight"))},
        "e_score_correction_bias": _leaf(stack, (e,), _named(mlp, "gate.e_score_correction_bias"), "id",
                                         default=0.0),
        "experts": _experts(config, stack, mlp, fused),
        "shared_experts": _mlp(stack, _named(mlp, "shared_experts."), d,
                               config.moe_intermediate_size * config.n_shared_experts),
    }
    return layer


def _fixed(name: str) -> NameFn:
    return lambda index: name


def mtp_prefix(config: ModelConfig) -> str:
    return f"model.layers.{config.num_hidden_layers}."


def param_recipes(config: ModelConfig, *, fused_experts: bool = False, fused_mtp_experts: bool | None = None,
                  tied_head: bool = False, with_mtp: bool = True) -> dict:
    """The recipe of every leaf, in the tree structure of `init(config)` (without "mtp" unless `with_mtp`).
    `fused_experts` / `fused_mtp_experts` pick the experts' layout of the main stack / MTP layer (the latter
    defaults to the former); `tied_head` reads lm_head from the embedding (no lm_head.weight stored)."""
    d, v = config.hidden_size, config.vocab_size
    nd, nm = config.num_dense_layers, config.num_moe_layers
    full = [i for i, t in enumerate(config.layer_indexer_types) if t == "full"]
    recipes = {
        "embed": {"embedding": _leaf((), (v, d), _fixed("model.embed_tokens.weight"), "id")},
        "indexers": _indexer(config, (len(full),), lambda index: f"model.layers.{full[index[0]]}.self_attn.indexer."),
        "final_norm": {"scale": _leaf((), (d,), _fixed("model.norm.weight"), "id")},
        "lm_head": {"kernel": _leaf((), (d, v), _fixed("model.embed_tokens.weight" if tied_head else
                                                         "lm_head.weight"))},
    }
    if nd:
        recipes["dense_layers"] = _layer(config, (nd,), lambda index: f"model.layers.{index[0]}.", moe=False,
                                         fused=fused_experts)
    if nm:
        recipes["moe_layers"] = _layer(config, (nm,), lambda index: f"model.layers.{nd + index[0]}.", moe=True,
                                       fused=fused_experts)
    if with_mtp and config.num_nextn_predict_layers:
        prefix = _fixed(mtp_prefix(config))
        layer = _layer(config, (), prefix, moe=True,
                       fused=fused_experts if fused_mtp_experts is None else fused_mtp_experts)
        layer["indexer"] = _indexer(config, (), _named(prefix, "self_attn.indexer."))
        recipes["mtp"] = {
            "enorm": {"scale": _leaf((), (d,), _named(prefix, "enorm.weight"), "id")},
            "hnorm": {"scale": _leaf((), (d,), _named(prefix, "hnorm.weight"), "id")},
            "eh_proj": {"kernel": _leaf((), (2 * d, d), _named(prefix, "eh_proj.weight"))},
            "layer": layer,
            "shared_head_norm": {"scale": _leaf((), (d,), _named(prefix, "shared_head.norm.weight"), "id")},
        }
    return recipes


def is_recipe(x) -> bool:
    return isinstance(x, LeafRecipe)


def ignorable_names(config: ModelConfig) -> tuple[str, ...]:
    """Prefixes of tensors a checkpoint may hold that carry no weights of their own: copies of the embedding
    and head that some exporters store with the MTP layer."""
    prefix = mtp_prefix(config)
    return (prefix + "embed_tokens", prefix + "shared_head.head")
