"""Mixture of experts: sigmoid router with correction bias and group-limited top-k, dispatch backends,
and the ungated shared expert.

Backends (config `moe_backend`):
- `reference`: every expert on every token, weighted by the dense routing matrix (tests only);
- `ragged`: dropless; assignments sorted by expert and run as grouped matmuls with `jax.lax.ragged_dot`
  (on CPU, where XLA has no grouped kernel, the blocked layout of `glm5_jax.model.blocked_experts`);
- `ep`: expert parallelism with `shard_map` (`glm5_jax.model.expert_parallel`).
The routed experts' computations on one device live in `glm5_jax.model.experts`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.batch_local import mesh_platform, token_local
from glm5_jax.model.expert_parallel import experts_ep
from glm5_jax.model.experts import experts_ragged, experts_reference
from glm5_jax.model.layers import Linear, SwiGLU
from glm5_jax.model.variables import normal, param, router_bias


class RoutedExperts(nnx.Module):
    """The E routed experts' SwiGLU weights, stacked on a leading expert dim; the dispatch backends run them."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        std = config.initializer_range
        d, e, f = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
        self.gate_proj = param(normal(rngs, (e, d, f), std, dtype), ("experts", "expert_embed", "expert_mlp"))
        self.up_proj = param(normal(rngs, (e, d, f), std, dtype), ("experts", "expert_embed", "expert_mlp"))
        self.down_proj = param(normal(rngs, (e, f, d), std, dtype), ("experts", "expert_mlp", "expert_embed"))

    def arrays(self) -> dict[str, jax.Array]:
        """The weights as plain arrays: the dispatch backends pass them through shard_map and tree maps."""
        return {name: getattr(self, name)[...] for name in ("gate_proj", "up_proj", "down_proj")}


class MoE(nnx.Module):
    """Router (fp32 whatever the parameter dtype: its scores decide discrete choices), its correction bias,
    the routed experts and the ungated shared expert."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        self.config = config  # static: part of the graph definition, not of the state
        std = config.initializer_range
        d, e = config.hidden_size, config.n_routed_experts
        self.router = Linear((d, e), ("embed", "router_experts"), rngs, std, jnp.float32)
        self.e_score_correction_bias = router_bias(jnp.zeros((e,), jnp.float32), ("router_experts",))
        self.experts = RoutedExperts(config, rngs, dtype)
        self.shared_experts = SwiGLU(d, config.moe_intermediate_size * config.n_shared_experts, rngs, std, dtype)

    def route(self, x: jax.Array, expert_choices: jax.Array | None = None,
              mesh=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Pick experts per token. x [T, D] or [B, S, D] -> (expert ids [..., A] int32, weights [..., A] fp32,
        scores s [..., E]).

        The correction bias only shifts *selection*; the weights are the unbiased scores, normalised and
        scaled. `expert_choices` [..., A] replays recorded choices (routing replay): the bias is then ignored
        entirely. The top-k runs on each device's own tokens (`token_local`)."""
        config = self.config
        scores = jax.nn.sigmoid(self.router(x.astype(jnp.float32)))  # sigmoid affinities [..., E] in fp32
        if expert_choices is None:
            bias = jax.lax.stop_gradient(self.e_score_correction_bias[...]).astype(jnp.float32)
            expert_ids = token_local(lambda c: choose_experts(c, config), mesh, (scores + bias,),
                                     token_dims=x.ndim - 1)
        else:
            expert_ids = expert_choices
        expert_ids = jax.lax.stop_gradient(expert_ids).astype(jnp.int32)
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return expert_ids, weights * config.routed_scaling_factor, scores

    def __call__(self, x: jax.Array, token_mask: jax.Array, expert_choices: jax.Array | None = None,
                 mesh=None) -> tuple[jax.Array, dict]:
        """x [B, S, D] -> (output [B, S, D], aux with expert counts, balance terms and the chosen experts)."""
        config = self.config
        # Tokens stay [B, S, ...] outside the per-device dispatch, split like the activations (batch axes on B,
        # `context` on S); each device flattens its own block (`token_local`, `experts_ep`).
        b, s, d = x.shape
        expert_ids, weights, scores = self.route(x, expert_choices, mesh)
        experts = self.experts.arrays()
        backend = config.moe_backend
        if backend == "reference":
            routed = experts_reference(experts, x.reshape(b * s, d), expert_ids.reshape(b * s, -1),
                                       weights.reshape(b * s, -1)).reshape(b, s, d)
            aux_extra = {}
        elif backend == "ragged":
            # Sort-based dispatch of each device's own tokens; the expert weights are gathered whole (as FSDP
            # does per layer), their gradients summed over the shards by shard_map's transpose.
            platform = mesh_platform(mesh)
            routed = token_local(lambda x, ids, w, experts: experts_ragged(experts, x, ids, w, platform), mesh,
                                 (x, expert_ids, weights), (experts,), token_dims=2)
            aux_extra = {}
        else:
            routed, aux_extra = experts_ep(experts, x, expert_ids, weights, config, mesh)
        out = routed + self.shared_experts(x)
        aux = {
            "expert_counts": expert_counts(expert_ids.reshape(b * s, -1), token_mask.reshape(-1),
                                           config.n_routed_experts),
            "balance_terms": sequence_balance_terms(scores, expert_ids, token_mask, config),
            "expert_ids": expert_ids,
            **aux_extra,
        }
        return out, aux


def choose_experts(choice: jax.Array, config: ModelConfig) -> jax.Array:
    """Group-limited top-k over biased scores choice [T, E] -> expert ids [T, A] int32."""
    if config.topk_group < config.n_group:
        n_tokens = choice.shape[0]
        grouped = choice.reshape(n_tokens, config.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        _, keep_groups = jax.lax.top_k(group_scores, config.topk_group)
        group_keep = jnp.zeros((n_tokens, config.n_group), bool).at[
            jnp.arange(n_tokens)[:, None], keep_groups].set(True)
        choice = jnp.where(jnp.repeat(group_keep, grouped.shape[-1], axis=1), choice, -jnp.inf)
    return jax.lax.top_k(choice, config.num_experts_per_tok)[1].astype(jnp.int32)


def expert_counts(expert_ids: jax.Array, token_mask: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert [E] (int32), counting real (unmasked) tokens only."""
    hits = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.int32).sum(1)  # [T, E]
    return (hits * token_mask[:, None].astype(jnp.int32)).sum(0)


def sequence_balance_terms(scores: jax.Array, expert_ids: jax.Array, token_mask: jax.Array,
                           config: ModelConfig) -> jax.Array:
    """Per-row sum_i f_i * P_i of the sequence-wise balance loss (weight alpha applied by the loss).

    scores [B, S, E], expert_ids [B, S, A], token_mask [B, S]. f_i = E/(A*T) * #tokens routed to i,
    P_i = mean over tokens of the normalised affinity s_i / sum_j s_j. Returns [B]."""
    n_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    mask = token_mask.astype(jnp.float32)
    n_real = jnp.maximum(mask.sum(-1), 1.0)  # [B]
    hits = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32).sum(2) * mask[..., None]  # [B, S, E]
    f = hits.sum(1) * n_experts / (top_k * n_real[:, None])
    normalised = scores / scores.sum(-1, keepdims=True)
    p = (normalised * mask[..., None]).sum(1) / n_real[:, None]
    return (jax.lax.stop_gradient(f) * p).sum(-1)
