"""The whole model as a Flax NNX module, `GLM5`: embedding -> dense stack -> MoE stack (each run with
`jax.lax.scan`, unrolled when the config says `scan_layers: false`) -> norm -> head, plus the shared-parameter
MTP module. `init` gives its state's pure dict (the parameter tree); `forward(params, tokens, config=...)` is the
pure function over that tree (it merges the tree into the module, inside `jax.jit` when called there).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm5_jax.config import REMAT_POLICIES, ModelConfig
from glm5_jax.distributed.logical_axes import constrain
from glm5_jax.model.decoder import DecoderLayer, LayerContext
from glm5_jax.model.indexer import Indexer
from glm5_jax.model.kv_cache import KVCache, LayerCache
from glm5_jax.model.layers import Embed, Linear, Scale, rope_angles
from glm5_jax.model.mtp import MTP
from glm5_jax.model.variables import ParamModule
from glm5_jax.model.validation import validate_forward_inputs

ACTIVATION_AXES = ("batch", "seq", "embed")


class ModelOutput(NamedTuple):
    logits: jax.Array | None       # [B, S, V] fp32 (None when return_logits=False)
    mtp_logits: jax.Array | None   # [D, B, S, V] fp32; depth k (1-based) predicts t_{i+k+1}
    hidden: jax.Array              # [B, S, D] final normed hidden state (what the LM head reads)
    mtp_hidden: jax.Array | None   # [D, B, S, D] normed MTP hidden states
    aux: dict[str, Any]
    cache: KVCache | None = None   # the decoding cache with the new tokens written (when one was given)


def dtype_of(name: str):
    return jnp.dtype(name)


def full_indexer_slots(config: ModelConfig) -> np.ndarray:
    """For every layer, the slot of the `indexers` stack it uses (shared layers point at their source)."""
    is_full = np.array([t == "full" for t in config.layer_indexer_types])
    return np.cumsum(is_full) - 1


class GLM5(ParamModule):
    """The whole model: embedding, the dense and MoE decoder stacks (each a `DecoderLayer` stacked on a leading
    "layers" axis with `nnx.vmap`), the stack of indexers of the "full" layers, final norm, LM head and the MTP
    module. Its state's pure dict is the parameter tree the rest of the package uses:

        model = GLM5(config, nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        forward(nnx.to_pure_dict(state), tokens, config=config)   # == model(tokens)
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, *, with_mtp: bool | None = None):
        config.validate()
        self.config = config  # static: part of the graph definition, not of the state
        dtype = dtype_of(config.param_dtype)
        d, v, std = config.hidden_size, config.vocab_size, config.initializer_range
        n_full = sum(t == "full" for t in config.layer_indexer_types)
        self.embed = Embed(v, d, rngs, std, dtype)
        if config.num_dense_layers:
            self.dense_layers = _stacked(lambda r: DecoderLayer(config, r, dtype, moe=False),
                                         rngs, config.num_dense_layers)
        if config.num_moe_layers:
            self.moe_layers = _stacked(lambda r: DecoderLayer(config, r, dtype, moe=True), rngs, config.num_moe_layers)
        self.indexers = _stacked(lambda r: Indexer(config, r, dtype), rngs, n_full)
        self.final_norm = Scale(d, dtype)
        self.lm_head = Linear((d, v), ("embed", "vocab"), rngs, std, dtype)
        if config.num_nextn_predict_layers if with_mtp is None else with_mtp:
            self.mtp = MTP(config, rngs, dtype)

    def __call__(self, tokens: jax.Array, **options) -> ModelOutput:
        """`model_forward` with this model's config; options as there."""
        return model_forward(self, tokens, config=self.config, **options)


def _stacked(make, rngs: nnx.Rngs, n: int):
    """`n` independently initialised copies of a module, stacked on a leading "layers" axis."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r):
        return make(r)
    return build(rngs)


def init(config: ModelConfig, rng: jax.Array) -> dict:
    """The parameter tree of a freshly initialised model: the pure dict of `GLM5(config)`'s state (layers of
    one kind stacked on a leading axis, the router and its correction bias in fp32). Compiled as one program
    (under `jax.eval_shape` it allocates nothing)."""
    config.validate()
    return _init_compiled(config, rng)


def _init(config: ModelConfig, rng: jax.Array) -> dict:
    return nnx.to_pure_dict(nnx.state(GLM5(config, nnx.Rngs(params=rng))))


_init_compiled = jax.jit(_init, static_argnums=0)


@functools.lru_cache(maxsize=64)
def graphdef(config: ModelConfig, with_mtp: bool | None = None) -> nnx.GraphDef:
    """The static structure of `GLM5(config)` (built from shapes only), to merge a parameter tree into."""
    return nnx.split(nnx.eval_shape(lambda: GLM5(config, nnx.Rngs(0), with_mtp=with_mtp)))[0]


def merge(params, config: ModelConfig) -> GLM5:
    """The model holding `params` (a pure dict or an `nnx.State`; host numpy arrays become device arrays);
    the MTP module only when params hold it."""
    with_mtp = bool(config.num_nextn_predict_layers) and "mtp" in params
    return nnx.merge(graphdef(config, with_mtp), jax.tree.map(jnp.asarray, params))


def _run_stack(stack: DecoderLayer, indexers: Indexer, x: jax.Array, topk: jax.Array, ctx: LayerContext,
               config: ModelConfig, layer_ids: np.ndarray, *, collect_routing: bool,
               expert_choices: jax.Array | None, topk_override: jax.Array | None, indexer_mode: str | None,
               mesh, cache: KVCache | None, positions: jax.Array) -> tuple:
    """Scan one stack: each step merges one layer's slice of the stacked state (and its indexer's) back into
    modules, so the layer compiles once whatever the depth. With a cache, each layer writes its rows into it
    (the cache travels in the scan's carry)."""
    types = [config.layer_indexer_types[i] for i in layer_ids]
    all_full = all(t == "full" for t in types)
    slots = full_indexer_slots(config)[layer_ids]
    layer_def, layer_state = nnx.split(stack)
    indexer_def, indexer_state = nnx.split(indexers)
    xs = {"layer": layer_state, "indexer": jax.tree.map(lambda a: a[slots], indexer_state),
          "is_full": jnp.asarray([t == "full" for t in types])}
    if expert_choices is not None:
        xs["expert_choices"] = expert_choices
    if topk_override is not None:
        xs["topk_override"] = topk_override
    if cache is not None:
        xs["layer_id"] = jnp.asarray(layer_ids, jnp.int32)
        xs["slot"] = jnp.asarray(slots, jnp.int32)

    def body(carry, xs_l):
        h, prev_topk, kv = carry
        layer, indexer = nnx.merge(layer_def, xs_l["layer"]), nnx.merge(indexer_def, xs_l["indexer"])
        h = constrain(h, ACTIVATION_AXES, mesh)  # layer boundary: batch over data/fsdp, model dim replicated
        layer_cache = None if kv is None else LayerCache(kv, xs_l["layer_id"], xs_l["slot"], positions)
        out = layer(indexer, h, ctx, prev_topk, config, run_indexer=True if all_full else xs_l["is_full"],
                    expert_choices=xs_l.get("expert_choices"), topk_override=xs_l.get("topk_override"),
                    indexer_mode=indexer_mode, mesh=mesh, cache=layer_cache)
        aux = dict(out.aux, topk=out.topk) if collect_routing else {
            k: v for k, v in out.aux.items() if k != "expert_ids"}
        kv = None if out.cache is None else out.cache.kv
        return (constrain(out.hidden, ACTIVATION_AXES, mesh), out.topk, kv), aux

    if config.remat_policy != "none" and cache is None:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[config.remat_policy])
    (x, topk, cache), aux = jax.lax.scan(body, (x, topk, cache), xs, unroll=not config.scan_layers)
    return x, topk, cache, aux


def forward(params, tokens: jax.Array, *, config: ModelConfig, **options) -> ModelOutput:
    """The pure forward pass over a parameter tree (the model state's pure dict, or an `nnx.State`): merges
    it into `GLM5` (inside `jax.jit` when called there) and runs `model_forward`. Options as there."""
    validate_forward_inputs(params, tokens, options.get("positions"), options.get("segment_ids"), config,
                            options.get("expert_choices"), options.get("topk_indices"))
    return model_forward(merge(params, config), tokens, config=config, **options)


def layer_context(positions: jax.Array, segment_ids: jax.Array, config: ModelConfig) -> LayerContext:
    """What every layer shares for tokens at `positions` [B, S] with `segment_ids` [B, S] (0 = padding)."""
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    return LayerContext(cos=cos, sin=sin, segment_ids=segment_ids, token_mask=segment_ids > 0)


def model_forward(params: GLM5, tokens: jax.Array, *, config: ModelConfig, positions: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, return_logits: bool = True, mtp_steps: int | None = None,
                  collect_routing: bool = False, expert_choices: jax.Array | None = None,
                  topk_indices: jax.Array | None = None, indexer_mode: str | None = None, mesh=None,
                  cache: KVCache | None = None) -> ModelOutput:
    """The forward pass of a `GLM5` module (what `GLM5.__call__` and `forward` run).

    tokens [B, S] int; positions [B, S] (default 0..S-1; restart per packed document); segment_ids [B, S]
    (default all 1; 0 = padding; attention, indexer and MTP never cross a segment boundary).
    `mtp_steps` overrides config.mtp_num_steps (0 disables MTP). `collect_routing` adds the per-layer top-k
    indices (`aux["topk"]` [L, B, S, N]) and expert choices (`aux["expert_ids"]` [L_moe, B, S, A]) to aux;
    `expert_choices` / `topk_indices` with those shapes replay recorded routing (routing replay).
    `indexer_mode` ("dense_warmup" | "sparse") adds per-layer indexer KL terms to aux (DSA training).
    `cache` runs the tokens as new entries at absolute `positions` against a decoding cache (prefill, decode,
    speculative verification; `segment_ids` then only mark real tokens) and returns it with their rows
    written; the top-k then has min(index_topk, cache length) slots.
    """
    validate_forward_inputs(params, tokens, positions, segment_ids, config, expert_choices, topk_indices)
    b, s = tokens.shape
    cdt = dtype_of(config.compute_dtype)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    ctx = layer_context(positions, segment_ids, config)

    x = params.embed(tokens, cdt)
    keys = s if cache is None else cache.latent.shape[2]
    topk = jnp.zeros((b, s, min(config.index_topk, keys)), jnp.int32)
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
        x, topk, cache, aux_by_stack[name] = _run_stack(
            getattr(params, name), params.indexers, x, topk, ctx, config, layer_ids, collect_routing=collect_routing,
            expert_choices=choices, topk_override=override, indexer_mode=indexer_mode, mesh=mesh, cache=cache,
            positions=positions)

    hidden = params.final_norm.rms_norm(x, config.rms_norm_eps)
    aux = dict(aux_by_stack.get("moe_layers", {}))
    if indexer_mode is not None:
        for key in ("indexer_kl_sum", "indexer_kl_count", "topk_mass_sum"):
            aux[key] = jnp.concatenate([aux_by_stack[n][key] for n, _ in stacks])
    if collect_routing:
        aux["topk"] = jnp.concatenate([aux_by_stack[n]["topk"] for n, _ in stacks])

    steps = config.mtp_num_steps if mtp_steps is None else mtp_steps
    mtp_hidden = mtp_logits = None
    if steps and "mtp" in params:
        mtp_hidden, aux["mtp"] = params.mtp(params.embed["embedding"], hidden, tokens, ctx, config, steps, mesh,
                                            indexer_mode)
        if not collect_routing:
            aux["mtp"].pop("expert_ids", None)
    logits = None
    if return_logits:
        logits = lm_head_logits(params, hidden)
        if mtp_hidden is not None:
            mtp_logits = lm_head_logits(params, mtp_hidden)
    return ModelOutput(logits=logits, mtp_logits=mtp_logits, hidden=hidden, mtp_hidden=mtp_hidden, aux=aux,
                       cache=cache)


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
