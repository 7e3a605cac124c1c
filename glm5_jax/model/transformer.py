"""The whole model: embedding -> dense stack -> MoE stack (each run with `jax.lax.scan`, unrolled when the config
says `scan_layers: false`) -> norm -> head, plus the shared-parameter MTP module. `init` builds the parameter pytree;
`forward` is a pure function.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import REMAT_POLICIES, ModelConfig
from glm5_jax.distributed.logical_axes import constrain
from glm5_jax.model.decoder import LayerContext, decoder_layer, init_layer
from glm5_jax.model.indexer import init_indexer
from glm5_jax.model.layers import normal_init, rms_norm, rope_angles
from glm5_jax.model.mtp import init_mtp, mtp_forward
from glm5_jax.model.validation import validate_forward_inputs

ACTIVATION_AXES = ("batch", "seq", "embed")

class ModelOutput(NamedTuple):
    logits: jax.Array | None       # [B, S, V] fp32 (None when return_logits=False)
    mtp_logits: jax.Array | None   # [D, B, S, V] fp32; depth k (1-based) predicts t_{i+k+1}
    hidden: jax.Array              # [B, S, D] final normed hidden state (what the LM head reads)
    mtp_hidden: jax.Array | None   # [D, B, S, D] normed MTP hidden states
    aux: dict[str, Any]


def dtype_of(name: str):
    return jnp.dtype(name)


def full_indexer_slots(config: ModelConfig) -> np.ndarray:
    """For every layer, the slot of the `indexers` stack it uses (shared layers point at their source)."""
    is_full = np.array([t == "full" for t in config.layer_indexer_types])
    return np.cumsum(is_full) - 1


def init(config: ModelConfig, rng: jax.Array) -> dict:
    """Build the parameter pytree: plain nested dicts, layers of one kind stacked on a leading axis, the
    indexers of "full" layers in their own stack, the router (and its correction bias) in fp32.
    Compiled as one program (under `jax.eval_shape` it allocates nothing)."""
    config.validate()
    return _init_compiled(config, rng)


def _init(config: ModelConfig, rng: jax.Array) -> dict:
    dtype = dtype_of(config.param_dtype)
    keys = jax.random.split(rng, 7)
    d, v = config.hidden_size, config.vocab_size
    n_full = sum(t == "full" for t in config.layer_indexer_types)

    def stack(fn, key, n):
        return jax.vmap(fn)(jax.random.split(key, n))

    params = {
        "embed": {"embedding": normal_init(keys[0], (v, d), config.initializer_range, dtype)},
        "dense_layers": stack(lambda k: init_layer(config, k, dtype, moe=False), keys[1], config.num_dense_layers),
        "moe_layers": stack(lambda k: init_layer(config, k, dtype, moe=True), keys[2], config.num_moe_layers),
        "indexers": stack(lambda k: init_indexer(config, k, dtype), keys[3], n_full),
        "final_norm": {"scale": jnp.ones((d,), dtype)},
        "lm_head": {"kernel": normal_init(keys[4], (d, v), config.initializer_range, dtype)},
    }
    if config.num_moe_layers == 0:
        del params["moe_layers"]
    if config.num_dense_layers == 0:
        del params["dense_layers"]
    if config.num_nextn_predict_layers:
        params["mtp"] = init_mtp(config, keys[5], dtype)
    return params


_init_compiled = jax.jit(_init, static_argnums=0)


def _run_stack(stack: dict, indexers: dict, x: jax.Array, topk: jax.Array, ctx: LayerContext,
               config: ModelConfig, layer_ids: np.ndarray, *, collect_routing: bool,
               expert_choices: jax.Array | None, topk_override: jax.Array | None, indexer_mode: str | None,
               mesh) -> tuple:
    types = [config.layer_indexer_types[i] for i in layer_ids]
    all_full = all(t == "full" for t in types)
    slots = full_indexer_slots(config)[layer_ids]
    layer_indexers = jax.tree.map(lambda a: a[slots], indexers)
    xs = {"layer": stack, "indexer": layer_indexers, "is_full": jnp.asarray([t == "full" for t in types])}
    if expert_choices is not None:
        xs["expert_choices"] = expert_choices
    if topk_override is not None:
        xs["topk_override"] = topk_override

    def body(carry, xs_l):
        h, prev_topk = carry
        h = constrain(h, ACTIVATION_AXES, mesh)  # layer boundary: batch over data/fsdp, model dim replicated
        h, new_topk, aux = decoder_layer(
            xs_l["layer"], xs_l["indexer"], h, ctx, prev_topk, config,
            run_indexer=True if all_full else xs_l["is_full"],
            expert_choices=xs_l.get("expert_choices"), topk_override=xs_l.get("topk_override"),
            indexer_mode=indexer_mode, mesh=mesh)
        if not collect_routing:
            aux = {k: v for k, v in aux.items() if k != "expert_ids"}
        else:
            aux = dict(aux, topk=new_topk)
        return (constrain(h, ACTIVATION_AXES, mesh), new_topk), aux

    if config.remat_policy != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[config.remat_policy])
    (x, topk), aux = jax.lax.scan(body, (x, topk), xs, unroll=not config.scan_layers)
    return x, topk, aux


def forward(params: dict, tokens: jax.Array, *, config: ModelConfig, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, return_logits: bool = True, mtp_steps: int | None = None,
            collect_routing: bool = False, expert_choices: jax.Array | None = None,
            topk_indices: jax.Array | None = None, indexer_mode: str | None = None, mesh=None) -> ModelOutput:
    """Pure forward pass.

    tokens [B, S] int; positions [B, S] (default 0..S-1; restart per packed document); segment_ids [B, S]
    (default all 1; 0 = padding; attention, indexer and MTP never cross a segment boundary).
    `mtp_steps` overrides config.mtp_num_steps (0 disables MTP). `collect_routing` adds the per-layer top-k
    indices (`aux["topk"]` [L, B, S, N]) and expert choices (`aux["expert_ids"]` [L_moe, B, S, A]) to aux;
    `expert_choices` / `topk_indices` with those shapes replay recorded routing (routing replay).
    `indexer_mode` ("dense_warmup" | "sparse") adds per-layer indexer KL terms to aux (DSA training).
    """
    validate_forward_inputs(params, tokens, positions, segment_ids, config, expert_choices, topk_indices)
    b, s = tokens.shape
    cdt = dtype_of(config.compute_dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    ctx = LayerContext(cos=cos, sin=sin, segment_ids=segment_ids, token_mask=segment_ids > 0)

    x = params["embed"]["embedding"][tokens].astype(cdt)
    topk = jnp.zeros((b, s, min(config.index_topk, s)), jnp.int32)
    nd = config.num_dense_layers
    stacks = []
    if nd:
        stacks.append(("dense_layers", np.arange(nd)))
    if config.num_moe_layers:
        stacks.append(("moe_layers", np.arange(nd, config.num_hidden_layers)))
    aux_by_stack = {}
    for name, layer_ids in stacks:
        choices = expert_choices if name == "moe_layers" else None
        override = None if topk_indices is None else topk_indices[layer_ids[0]: layer_ids[-1] + 1]
        x, topk, aux_by_stack[name] = _run_stack(
            params[name], params["indexers"], x, topk, ctx, config, layer_ids, collect_routing=collect_routing,
            expert_choices=choices, topk_override=override, indexer_mode=indexer_mode, mesh=mesh)

    hidden = rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)
    aux = dict(aux_by_stack.get("moe_layers", {}))
    if indexer_mode is not None:
        for key in ("indexer_kl_sum", "indexer_kl_count", "topk_mass_sum"):
            aux[key] = jnp.concatenate([aux_by_stack[n][key] for n, _ in stacks])
    if collect_routing:
        aux["topk"] = jnp.concatenate([aux_by_stack[n]["topk"] for n, _ in stacks])

    steps = config.mtp_num_steps if mtp_steps is None else mtp_steps
    mtp_hidden = mtp_logits = None
    if steps and "mtp" in params:
        mtp_hidden, aux["mtp"] = mtp_forward(params["mtp"], params["embed"]["embedding"], hidden, tokens, ctx,
                                             config, steps, mesh, indexer_mode)
        if not collect_routing:
            aux["mtp"].pop("expert_ids", None)
    logits = None
    if return_logits:
        logits = lm_head_logits(params, hidden)
        if mtp_hidden is not None:
            mtp_logits = lm_head_logits(params, mtp_hidden)
    return ModelOutput(logits=logits, mtp_logits=mtp_logits, hidden=hidden, mtp_hidden=mtp_hidden, aux=aux)


def lm_head_logits(params: dict, hidden: jax.Array) -> jax.Array:
    kernel = params["lm_head"]["kernel"].astype(hidden.dtype)
    return jnp.einsum("...D,DV->...V", hidden, kernel, preferred_element_type=jnp.float32)


_STATIC_FORWARD_ARGS = ("config", "return_logits", "mtp_steps", "collect_routing", "indexer_mode", "mesh")
_forward_compiled = jax.jit(forward, static_argnames=_STATIC_FORWARD_ARGS)


def jit_forward(params: dict, tokens: jax.Array, *, config: ModelConfig, **kwargs) -> ModelOutput:
    """`forward` compiled once per (config, static options, shapes); inputs are validated on their concrete
    values first, since inside the compiled function they are only shapes."""
    validate_forward_inputs(params, tokens, kwargs.get("positions"), kwargs.get("segment_ids"), config,
                            kwargs.get("expert_choices"), kwargs.get("topk_indices"))
    return _forward_compiled(params, tokens, config=config, **kwargs)
