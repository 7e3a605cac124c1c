"""The whole model as a Flax NNX module, `GLM5`: embedding -> dense stack -> MoE stack (each run with
`jax.lax.scan`, unrolled when the config says `scan_layers: false`) -> norm -> head, plus the shared-parameter
MTP module. Two ways in: call the module (`model(tokens, ...)`), or `forward(state, tokens, config=...)`, the
one pure function over its state (an `nnx.State` or its pure dict, as `init` gives): it merges the state into
the module, inside `jax.jit` when called there, for jit, optax and orbax.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm5_jax.config import REMAT_POLICIES, ModelConfig
from glm5_jax.distributed.batch_local import context_split
from glm5_jax.distributed.context_order import to_balanced, to_natural
from glm5_jax.distributed.logical_axes import constrain
from glm5_jax.model.context import LayerContext, layer_context
from glm5_jax.model.decoder import DecoderLayer
from glm5_jax.model.indexer import Indexer
from glm5_jax.model.kv_cache import KVCache, LayerCache
from glm5_jax.model.layers import Embed, Linear, Scale
from glm5_jax.model.mtp import MTP
from glm5_jax.model.validation import validate_forward_inputs, validate_params

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


def head_logits(kernel: jax.Array, hidden: jax.Array) -> jax.Array:
    """The LM head: hidden [..., D] times its kernel [D, V] -> fp32 logits [..., V]."""
    return jnp.einsum("...D,DV->...V", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)


class GLM5(nnx.Module):
    """The whole model: embedding, the dense and MoE decoder stacks (each a `DecoderLayer` stacked on a leading
    "layers" axis with `nnx.vmap`), the stack of indexers of the "full" layers, final norm, LM head and the MTP
    module. Its state's pure dict is the parameter tree that optax, orbax and the converter see:

        model = GLM5(config, nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        forward(state, tokens, config=config)   # == model(tokens)
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

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_logits: bool = True, mtp_steps: int | None = None,
                 collect_routing: bool = False, expert_choices: jax.Array | None = None,
                 topk_indices: jax.Array | None = None, indexer_mode: str | None = None, mesh=None,
                 cache: KVCache | None = None) -> ModelOutput:
        """The forward pass.

        tokens [B, S] int; positions [B, S] (default 0..S-1; restart per packed document); segment_ids [B, S]
        (default all 1; 0 = padding; attention, indexer and MTP never cross a segment boundary).
        `mtp_steps` overrides config.mtp_num_steps (0 disables MTP). `collect_routing` adds the per-layer
        top-k indices (`aux["topk"]` [L, B, S, N]) and expert choices (`aux["expert_ids"]` [L_moe, B, S, A])
        to aux; `expert_choices` / `topk_indices` with those shapes replay recorded routing (routing replay).
        `indexer_mode` ("dense_warmup" | "sparse") adds per-layer indexer KL terms to aux (DSA training).
        `mesh`: the device mesh the batch is split over (per-device top-k, dispatch and kernels).
        `cache` runs the tokens as new entries at absolute `positions` against a decoding cache (prefill,
        decode, speculative verification; `segment_ids` then only mark real tokens) and returns it with their
        rows written; the top-k then has min(index_topk, cache length) slots.
        """
        config = self.config
        validate_forward_inputs(tokens, positions, segment_ids, config, expert_choices, topk_indices)
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        # Under a context split the layers run in the load-balanced order (training and scoring; a cache keeps
        # the natural order): inputs move into it here and per-token outputs move back below.
        balance = cache is None and context_split(mesh) > 1
        natural_tokens, natural_segments = tokens, segment_ids
        if balance:
            tokens, positions, segment_ids = (to_balanced(x, mesh) for x in (tokens, positions, segment_ids))
            expert_choices, topk_indices = (None if x is None else to_balanced(x, mesh, axis=2)
                                            for x in (expert_choices, topk_indices))
        ctx = layer_context(positions, segment_ids, config)

        x = self.embed(tokens, dtype_of(config.compute_dtype), mesh)
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
            x, topk, cache, aux_by_stack[name] = self._run_stack(
                getattr(self, name), x, topk, ctx, layer_ids, collect_routing=collect_routing,
                expert_choices=choices, topk_override=override, indexer_mode=indexer_mode, mesh=mesh, cache=cache,
                positions=positions)

        hidden = constrain(self.final_norm.rms_norm(x, config.rms_norm_eps), ACTIVATION_AXES, mesh)
        aux = dict(aux_by_stack.get("moe_layers", {}))
        if indexer_mode is not None:
            for key in ("indexer_kl_sum", "indexer_kl_count", "topk_mass_sum"):
                aux[key] = jnp.concatenate([aux_by_stack[n][key] for n, _ in stacks])
        if collect_routing:
            aux["topk"] = jnp.concatenate([aux_by_stack[n]["topk"] for n, _ in stacks])

        steps = config.mtp_num_steps if mtp_steps is None else mtp_steps
        mtp_hidden = mtp_logits = None
        if steps and hasattr(self, "mtp"):
            mtp_hidden, aux["mtp"] = self.mtp(self.embed, hidden, natural_tokens, natural_segments, ctx, steps, mesh,
                                              indexer_mode, balanced=balance)
            if not collect_routing:
                aux["mtp"].pop("expert_ids", None)
        if balance:
            hidden = to_natural(hidden, mesh)
            mtp_hidden = None if mtp_hidden is None else to_natural(mtp_hidden, mesh, axis=2)
            for key, records in (("topk", aux), ("expert_ids", aux), ("expert_ids", aux.get("mtp", {}))):
                if key in records:  # recorded routing [layers or depths, B, S, ...]
                    records[key] = to_natural(records[key], mesh, axis=2)
        logits = None
        if return_logits:
            logits = self.logits(hidden)
            if mtp_hidden is not None:
                mtp_logits = self.logits(mtp_hidden)
        return ModelOutput(logits=logits, mtp_logits=mtp_logits, hidden=hidden, mtp_hidden=mtp_hidden, aux=aux,
                           cache=cache)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits [..., V] of normed hidden states [..., D]."""
        return head_logits(self.lm_head.kernel[...], hidden)

    def _run_stack(self, stack: DecoderLayer, x: jax.Array, topk: jax.Array, ctx: LayerContext,
                   layer_ids: np.ndarray, *, collect_routing: bool, expert_choices: jax.Array | None,
                   topk_override: jax.Array | None, indexer_mode: str | None, mesh, cache: KVCache | None,
                   positions: jax.Array) -> tuple:
        """Scan one stack: each step merges one layer's slice of the stacked state (and its indexer's) back
        into modules, so the layer compiles once whatever the depth. With a cache, each layer writes its rows
        into it (the cache travels in the scan's carry)."""
        config = self.config
        types = [config.layer_indexer_types[i] for i in layer_ids]
        all_full = all(t == "full" for t in types)
        slots = full_indexer_slots(config)[layer_ids]
        layer_def, layer_state = nnx.split(stack)
        indexer_def, indexer_state = nnx.split(self.indexers)
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
            out = layer(h, ctx, indexer=indexer, prev_topk=prev_topk,
                        run_indexer=True if all_full else xs_l["is_full"], expert_choices=xs_l.get("expert_choices"),
                        topk_override=xs_l.get("topk_override"), indexer_mode=indexer_mode, mesh=mesh,
                        cache=layer_cache)
            aux = dict(out.aux, topk=out.topk) if collect_routing else {
                k: v for k, v in out.aux.items() if k != "expert_ids"}
            kv = None if out.cache is None else out.cache.kv
            return (constrain(out.hidden, ACTIVATION_AXES, mesh), out.topk, kv), aux

        if config.remat_policy != "none" and cache is None:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[config.remat_policy])
        (x, topk, cache), aux = jax.lax.scan(body, (x, topk, cache), xs, unroll=not config.scan_layers)
        return x, topk, cache, aux


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


@functools.lru_cache(maxsize=64)
def _layer_graphdefs(config: ModelConfig, moe: bool) -> tuple[nnx.GraphDef, nnx.GraphDef]:
    dtype = dtype_of(config.param_dtype)
    layer = nnx.eval_shape(lambda: DecoderLayer(config, nnx.Rngs(0), dtype, moe=moe))
    return nnx.split(layer)[0], nnx.split(nnx.eval_shape(lambda: Indexer(config, nnx.Rngs(0), dtype)))[0]


def layer_modules(config: ModelConfig, stack: str, layer_state, indexer_state) -> tuple[DecoderLayer, Indexer]:
    """One layer of `stack` ("dense_layers" | "moe_layers") and one indexer, from their states without the
    leading "layers" axis (pure dicts or `nnx.State`), e.g. to trace a single layer."""
    layer_def, indexer_def = _layer_graphdefs(config, stack == "moe_layers")
    return nnx.merge(layer_def, layer_state), nnx.merge(indexer_def, indexer_state)


def merge(state, config: ModelConfig) -> GLM5:
    """The model holding `state` (its pure dict or an `nnx.State`; host numpy arrays become device arrays);
    the MTP module only when the state holds it."""
    with_mtp = bool(config.num_nextn_predict_layers) and "mtp" in state
    return nnx.merge(graphdef(config, with_mtp), jax.tree.map(jnp.asarray, state))


# The arguments of `forward` that select code paths or shapes: static under `jax.jit`.
FORWARD_STATIC_ARGNAMES = ("config", "return_logits", "mtp_steps", "collect_routing", "indexer_mode", "mesh")


def forward(state, tokens: jax.Array, *, config: ModelConfig, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, return_logits: bool = True, mtp_steps: int | None = None,
            collect_routing: bool = False, expert_choices: jax.Array | None = None,
            topk_indices: jax.Array | None = None, indexer_mode: str | None = None, mesh=None,
            cache: KVCache | None = None) -> ModelOutput:
    """The pure forward pass over the model's state (an `nnx.State` or its pure dict): merges it into `GLM5`
    (inside `jax.jit` when called there) and calls it. Arguments as `GLM5.__call__`; under `jax.jit` those
    named in `FORWARD_STATIC_ARGNAMES` are static. Values (token ids in the vocabulary, ...) are checked only
    outside `jax.jit`, where they are concrete."""
    validate_params(state, config)
    return merge(state, config)(tokens, positions=positions, segment_ids=segment_ids, return_logits=return_logits,
                                mtp_steps=mtp_steps, collect_routing=collect_routing, expert_choices=expert_choices,
                                topk_indices=topk_indices, indexer_mode=indexer_mode, mesh=mesh, cache=cache)
