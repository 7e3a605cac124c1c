"""Frozen configuration dataclasses, YAML loading, `key=value` overrides and validation.

Model fields carry the Hugging Face `GlmMoeDsaConfig` names so a released `config.json` maps one to one.
Every check runs in plain Python before anything is traced or compiled, and every error names the field,
the offending value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path
from typing import Any

import jax
import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or inconsistent with another one."""


def _fail(field: str, value: Any, valid: str) -> None:
    raise ConfigError(f"{field}={value!r} is invalid: {valid}")


def require_finite_floats(config, prefix: str) -> None:
    """Every float field of a config dataclass is finite (nan compares false, so range checks alone miss it)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            _fail(prefix + field.name, value, "must be a finite number (nan and inf are never valid settings)")


ATTENTION_BACKENDS = ("auto", "dense", "sparse", "pallas")
PALLAS_PLATFORMS = ("auto", "gpu", "tpu")
ROW_GRADIENTS = ("scatter", "atomic")  # pallas_kernels.sparse_mla's (config sits below the kernels' layer)
MOE_BACKENDS = ("reference", "ragged", "ep")
MAX_KERNEL_VMEM_MIB = 128  # above any TPU TensorCore's VMEM (libtpu refuses a kernel asking for more than its chip has)
INDEXER_TYPES = ("full", "shared")
DTYPES = ("float32", "bfloat16", "float16")
# `remat_policy` -> what a rematerialised layer keeps from its forward pass ("none" keeps everything).
# Activations saved under every remat policy, by `checkpoint_name`: the indexer's top-k selection is small
# (int32 [B, S, N]) but costs O(S x T) to recompute, so the backward pass reads it instead of re-running the indexer;
# with it its scores at those keys (fp32 [B, S, N], the sparse KL's forward value; DSA sparse stage only), except
# under `full_without_topk_scores`.
ALWAYS_SAVED = ("dsa_topk", "dsa_topk_scores")
_SAVE_ALWAYS = jax.checkpoint_policies.save_only_these_names(*ALWAYS_SAVED)
# The routed experts' grouped-matmul output (the gate and up projections of the received rows, one [rows, 2F]
# array): keeping it lets a rematerialised MoE layer's backward skip every routed-expert matmul of the recompute
# (their weight and input gradients need only it and the re-dispatched rows), at 2 x rows x F values per layer.
EXPERT_MATMUL_NAMES = ("expert_gate_up",)
EXPERT_MATMUL_POLICIES = ("full_keep_experts",)  # the policies that keep it (the planner counts it for them)
# Outputs of the attention's forward kernel (the sparse MLA kernel's latent output and log-sum-exp): they are
# also its custom VJP's residuals, which a `checkpoint_name` outside the kernel cannot reach (the name makes a new
# value; the backward still needs the kernel's own), so a policy that keeps them picks the kernel out by its
# function and module. Keeping them spares the backward pass a re-run of the forward kernel (its 2048-row gather
# per query). Where the top-k keeps every key, the TPU kernels attend by flash attention instead
# (`glm5_jax.ops.causal_attention`): its forward kernel's outputs (o, lse) are kept alike.
ATTENTION_FORWARD_KERNELS = (("_forward_kernel", "sparse_mla.py"), ("_forward_kernel", "tpu_sparse_mla.py"),
                             ("_flash_forward_kernel", "tpu_flash_attention.py"))
# The DSA sparse stage's KL target (head-mean attention probabilities at the selected keys, fp32 [B, S, N]): a
# constant of the indexer's KL gradient, so without it the backward re-runs the target kernel's row gather (GPU).
# On TPU the sparse MLA forward kernel writes the target itself and the backward re-runs that kernel anyway (for
# its residuals), so keeping the target spares nothing there: `full` measured less memory and no more traffic.
DSA_TARGET_NAMES = ("dsa_target",)
# The projections whose outputs are small for the recompute FLOPs they spare: the dense MLP's and the shared
# expert's gate and up outputs (2F values per token for 4 D F FLOPs) and the attention's two down-projections
# (q_a, kv_a: Q + C + R values for 2 D (Q + C + R)). GLM-5 on v6e-256, compiled: 4.5 GiB per chip for 1.5e13 FLOPs
# per step (benchmarks/BENCHMARKS.md, issue 24).
PROJECTION_NAMES = ("ffn_gate_up", "attention_down_proj")


def save_kernel_outputs(kernels: tuple[tuple[str, str], ...]):
    """A remat policy saving the outputs of the Pallas kernels named (function, module file name)."""
    def policy(prim, *_, **params):
        if prim.name != "pallas_call":
            return False
        name, _, where = (params["jaxpr"].debug_info.func_src_info or "").partition(" at ")
        return (name, Path(where.rsplit(":", 1)[0]).name) in kernels
    return policy


REMAT_POLICIES = {
    "none": None,
    "full": _SAVE_ALWAYS,
    "full_keep_experts": jax.checkpoint_policies.save_only_these_names(*ALWAYS_SAVED, *EXPERT_MATMUL_NAMES),
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable, _SAVE_ALWAYS),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _SAVE_ALWAYS),
    # `full` less the top-k's scores: the recompute re-runs the top-k kernel for them (v5p-512: +0.1 TB of HBM
    # traffic per step), for the pods where memory is short (v6e-256).
    "full_without_topk_scores": jax.checkpoint_policies.save_only_these_names("dsa_topk"),
    "full_keep_dsa_target": jax.checkpoint_policies.save_only_these_names(*ALWAYS_SAVED, *DSA_TARGET_NAMES),
    "full_keep_projections": jax.checkpoint_policies.save_only_these_names(*ALWAYS_SAVED, *DSA_TARGET_NAMES,
                                                                           *PROJECTION_NAMES),
    "full_keep_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(*ALWAYS_SAVED, *DSA_TARGET_NAMES),
        save_kernel_outputs(ATTENTION_FORWARD_KERNELS)),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GLM-5 architecture (HF names) plus the JAX-side choices (backends, dtypes, MTP depth, remat)."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    # GLM-5 rotates the indexer's rope dims as interleaved pairs; DeepSeek-V3.2 uses half-split.
    indexer_rope_interleaved: bool = True
    # Per layer "full" (runs its own indexer) or "shared" (reuses the previous full layer's top-k).
    # None means every layer is "full", as in GLM-5.
    indexer_types: tuple[str, ...] | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Multi-token prediction: number of MTP modules stored (GLM-5: 1) and how many times the shared
    # module is applied (GLM-5 trains with 3 steps sharing one set of parameters).
    num_nextn_predict_layers: int = 1
    mtp_num_steps: int = 3
    # JAX-side choices.
    # "auto" picks "dense" or "sparse" per call from the shapes (model/attention.py: choose_backend).
    attention_backend: str = "auto"
    # Kernels of the "pallas" backend: "auto" = those of the trainer's devices (Mosaic on TPUs, Triton on GPUs,
    # also when `glm5 compile` describes them on a CPU host; interpreted on CPU devices); "gpu" / "tpu" = that
    # platform's compiled kernels (the trainer refuses the other accelerator's by name).
    pallas_platform: str = "auto"
    # With the kernels, where DSA's selection is the causal mask itself (T <= index_topk; the dense warm-up):
    # attend by flash attention in the expanded form (`glm5_jax.ops.causal_attention`; jax's Mosaic kernels on
    # TPU, its Triton ones on GPU) instead of the sparse MLA kernel over every visible row, and run no top-k (the
    # sparse stage's KL over every visible key). One layer's sparse stage at 2048 tokens on TPU: 3-4x less
    # roofline time; the whole v6e-256 step: 27% less HBM traffic (5.29 -> 3.85 TB) for ~1 GiB more temporaries.
    flash_every_key: bool = True
    # How the Triton (GPU) sparse MLA backward sums each selected row's gradients into d(latent): "scatter"
    # (per-slot rows, then XLA's sort and scatter-add) or "atomic" (atomic adds in the kernel; no per-slot
    # buffer). `pallas_kernels.sparse_mla_attention`'s row_gradients; the TPU kernels always scatter.
    sparse_row_gradients: str = "scatter"
    moe_backend: str = "ragged"
    # Expert parallelism (moe_backend "ep"): 0 = dropless (buffers sized for the worst case); > 0 caps each
    # expert shard at capacity_factor * (its fair share of assignments) and drops the excess deterministically.
    moe_capacity_factor: float = 0.0
    ep_transport: str = "auto"  # "padded" all-to-all (portable, CPU) | "ragged" (ragged_all_to_all) | "auto"
    # Rows travel in blocks of this many, each chunk padded to whole blocks: on TPU a block of one tile's height
    # spares libtpu's relayout of every buffer the collective cuts (glm5_jax.model.expert_parallel). 0: the tile's
    # height on TPU (16 rows of bf16), 1 elsewhere.
    ep_row_block: int = 0
    # Scoped VMEM the routed experts' TPU kernels ask for, MiB, where one expert per chip runs them (moe_backend
    # "ep"): 0 = megablox's kernels within the chip's default (16 MiB on v5p, 32 on v6e); > 0 = the project's
    # one-group kernels with that limit of their own, tiled for it (larger row tiles re-read the expert's weights
    # fewer times; `pallas_kernels.tpu_one_group_matmul`). Google's v6e recipes give kernels 96 MiB of the 128.
    moe_kernel_vmem_mib: int = 0
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    remat_policy: str = "none"
    # True runs each layer stack under `lax.scan` (compile time independent of depth). False unrolls it, as
    # MaxText's `scan_layers: false`: no stacked residual buffers, ~7% faster steps for a shallow model on
    # CPU (benchmarks/BENCHMARKS.md), but compile time grows with the number of layers.
    scan_layers: bool = True
    # Query rows processed at once by the indexer and the sparse attention (bounds the [chunk, T] index scores
    # and the gathered [chunk, N, C+R] latent rows); 0 = all at once.
    index_query_chunk: int = 0
    # Keys scored at once by the jnp indexer top-k, whose selection is merged block by block into a running
    # top-k (equal to one top-k over all keys): bounds the score block to [chunk, key block] at long contexts;
    # 0 = every key at once.
    index_key_block: int = 0

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def pallas_options(self) -> dict:
        """platform / interpret keywords for the pallas_kernels entry points ({} = their defaults)."""
        return {} if self.pallas_platform == "auto" else dict(platform=self.pallas_platform, interpret=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of the absorbed-form cache row: normalised latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        return self.indexer_types or ("full",) * self.num_hidden_layers

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    def validate(self) -> "ModelConfig":
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(name, value, "must be a positive integer")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "mtp_num_steps",
                     "index_query_chunk", "index_key_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(name, value, "must be a non-negative integer")
        if self.qk_rope_head_dim % 2:
            _fail("qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
        if self.qk_rope_head_dim > self.index_head_dim:
            _fail("qk_rope_head_dim", self.qk_rope_head_dim,
                  f"the indexer rotates its first qk_rope_head_dim dims, so it must be <= index_head_dim "
                  f"({self.index_head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            _fail("num_experts_per_tok", self.num_experts_per_tok,
                  f"must be <= n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts % self.n_group:
            _fail("n_group", self.n_group, f"must divide n_routed_experts ({self.n_routed_experts})")
        if self.topk_group > self.n_group:
            _fail("topk_group", self.topk_group, f"must be <= n_group ({self.n_group})")
        experts_per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and experts_per_group < 2:
            _fail("n_group", self.n_group,
                  "group scores sum each group's top-2 experts, so every group needs >= 2 experts")
        if self.num_experts_per_tok > self.topk_group * experts_per_group:
            _fail("num_experts_per_tok", self.num_experts_per_tok,
                  f"must be <= topk_group * experts per group ({self.topk_group * experts_per_group})")
        if self.first_k_dense_replace > self.num_hidden_layers:
            _fail("first_k_dense_replace", self.first_k_dense_replace,
                  f"must be <= num_hidden_layers ({self.num_hidden_layers})")
        if self.hidden_act != "silu":
            _fail("hidden_act", self.hidden_act, "only 'silu' (SwiGLU) is supported")
        # `not x > 0` so that nan fails too; inf is refused by require_finite_floats.
        require_finite_floats(self, "")
        if not self.rope_theta > 0:
            _fail("rope_theta", self.rope_theta, "must be a finite number > 0")
        if not 0 < self.rms_norm_eps < 1:
            _fail("rms_norm_eps", self.rms_norm_eps, "must be in (0, 1)")
        if not self.routed_scaling_factor > 0:
            _fail("routed_scaling_factor", self.routed_scaling_factor, "must be a finite number > 0")
        if not self.initializer_range > 0:
            _fail("initializer_range", self.initializer_range, "must be a finite number > 0 (GLM-5: 0.02)")
        if self.num_nextn_predict_layers > 1:
            _fail("num_nextn_predict_layers", self.num_nextn_predict_layers,
                  "GLM-5 stores one MTP module (0 disables MTP); more are not supported")
        if self.mtp_num_steps > 0 and self.num_nextn_predict_layers == 0:
            _fail("mtp_num_steps", self.mtp_num_steps, "must be 0 when num_nextn_predict_layers is 0")
        if self.indexer_types is not None:
            types = tuple(self.indexer_types)
            if len(types) != self.num_hidden_layers:
                _fail("indexer_types", types, f"needs one entry per layer ({self.num_hidden_layers})")
            bad = [t for t in types if t not in INDEXER_TYPES]
            if bad:
                _fail("indexer_types", bad[0], f"entries must be one of {INDEXER_TYPES}")
            if types[0] != "full":
                _fail("indexer_types[0]", types[0], "the first layer has no earlier top-k to share: use 'full'")
        for name in ("scan_layers", "flash_every_key"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be true or false")
        if self.sparse_row_gradients == "atomic" and self.pallas_platform == "tpu":
            _fail("sparse_row_gradients", self.sparse_row_gradients, "the TPU kernels scatter: use 'scatter'")
        if not self.moe_capacity_factor >= 0:
            _fail("moe_capacity_factor", self.moe_capacity_factor, "must be >= 0 (0 = dropless)")
        if isinstance(self.ep_row_block, bool) or not isinstance(self.ep_row_block, int) or not (
                0 <= self.ep_row_block <= 1024):
            _fail("ep_row_block", self.ep_row_block, "must be an integer from 0 (the chip's tile height) to 1024")
        if isinstance(self.moe_kernel_vmem_mib, bool) or not isinstance(self.moe_kernel_vmem_mib, int) or not (
                self.moe_kernel_vmem_mib == 0 or 16 <= self.moe_kernel_vmem_mib <= MAX_KERNEL_VMEM_MIB):
            _fail("moe_kernel_vmem_mib", self.moe_kernel_vmem_mib,
                  f"must be 0 (the chip's default) or an integer from 16 to {MAX_KERNEL_VMEM_MIB}")
        for name, allowed in (("attention_backend", ATTENTION_BACKENDS), ("pallas_platform", PALLAS_PLATFORMS),
                              ("moe_backend", MOE_BACKENDS), ("sparse_row_gradients", ROW_GRADIENTS),
                              ("ep_transport", ("auto", "padded", "ragged")),
                              ("remat_policy", tuple(REMAT_POLICIES)), ("param_dtype", DTYPES),
                              ("compute_dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), f"must be one of {allowed}")
        return self


TRAIN_MODES = ("pretrain", "sft", "dsa_warmup", "dsa_sparse", "rl")
NON_FINITE_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What one optimizer step does and how a run is driven."""

    mode: str = "pretrain"
    steps: int = 100
    batch_size: int = 8            # sequences per optimizer step (all microbatches together)
    seq_len: int = 512
    microbatches: int = 1          # exact gradient accumulation over this many slices of the batch
    mtp_loss_weight: float = 0.3   # lambda of L_MTP = lambda/D sum_k CE_k (GLM-4.5: 0.3, later 0.1)
    balance_loss_weight: float = 1e-4
    bias_update_rate: float = 1e-3  # aux-loss-free balancing step u (GLM-4.5 / GLM-5)
    indexer_kl_weight: float = 1.0
    vocab_chunk: int = 8192
    peak_flops_per_device: float = 0.0  # for MFU; 0 = not reported
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0            # 0 = evaluate only at the end
    eval_batches: int = 4
    run_dir: str = "runs/default"
    # Start from another run's latest parameters (its run directory); the optimizer starts fresh.
    # Used to continue a dense-MLA model into DSA training, or to RL from an SFT model.
    init_from: str = ""
    # A step whose loss, gradients or new optimizer state is not finite is never applied nor saved:
    # "stop" ends the run naming the first non-finite leaf; "skip" keeps the previous state and goes on.
    non_finite: str = "stop"

    def validate(self) -> "TrainConfig":
        if self.mode not in TRAIN_MODES:
            _fail("train.mode", self.mode, f"must be one of {TRAIN_MODES}")
        for name in ("steps", "batch_size", "seq_len", "microbatches", "vocab_chunk", "log_every", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(f"train.{name}", value, "must be a positive integer")
        if self.init_from and not (Path(self.init_from) / "checkpoints").is_dir():
            _fail("train.init_from", self.init_from, "must be a run directory holding checkpoints/")
        if self.batch_size % self.microbatches:
            _fail("train.microbatches", self.microbatches, f"must divide train.batch_size ({self.batch_size})")
        require_finite_floats(self, "train.")
        for name in ("mtp_loss_weight", "balance_loss_weight", "bias_update_rate", "indexer_kl_weight",
                     "peak_flops_per_device"):
            if not getattr(self, name) >= 0:
                _fail(f"train.{name}", getattr(self, name), "must be a finite number >= 0")
        if self.non_finite not in NON_FINITE_POLICIES:
            _fail("train.non_finite", self.non_finite, f"must be one of {NON_FINITE_POLICIES}")
        return self


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from. `source`: "stdlib" (the Python standard library's own sources, on
    every machine), "jsonl" ({"text": ...} lines), "chat_jsonl" (messages), "rollouts" (RL records)."""

    source: str = "stdlib"
    paths: tuple[str, ...] = ()
    tokenizer: str = "byte"        # "byte" or a path to a Hugging Face tokenizer.json
    max_files: int = 0             # stdlib: 0 = all
    validation_fraction: float = 0.05
    shuffle: bool = True
    clear_thinking: bool = True    # chat: strip reasoning of earlier turns
    # Independent data streams that make up the global batch (glm5_jax.data.sharded); each process reads its
    # own. 0 = one per process. Batches depend on this number, not on the process count.
    shards: int = 0

    def validate(self) -> "DataConfig":
        sources = ("stdlib", "jsonl", "chat_jsonl", "rollouts")
        if self.source not in sources:
            _fail("data.source", self.source, f"must be one of {sources}")
        if self.source != "stdlib" and not self.paths:
            _fail("data.paths", self.paths, f"source {self.source!r} needs at least one path")
        for path in self.paths:
            if not Path(path).exists():
                _fail("data.paths", path, "file not found")
        if not 0 <= self.validation_fraction < 1:  # also refuses nan
            _fail("data.validation_fraction", self.validation_fraction, "must be in [0, 1)")
        if self.shards < 0:
            _fail("data.shards", self.shards, "must be >= 0 (0 = one stream per process)")
        return self


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100               # save every N steps (and at the end)
    keep: int = 3
    resume: bool = True            # continue from the latest checkpoint of the run directory

    def validate(self) -> "CheckpointConfig":
        for name in ("every", "keep"):
            if getattr(self, name) <= 0:
                _fail(f"checkpoint.{name}", getattr(self, name), "must be a positive integer")
        return self


# ---------------------------------------------------------------------------------------------
# Generic loading: nested dataclasses from dicts, YAML files and dotted `key=value` overrides.
# ---------------------------------------------------------------------------------------------

def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Turn a YAML/CLI value into the annotated type, or fail naming the field."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            _fail(path, value, f"must be a mapping of {annotation.__name__} fields")
        return from_dict(annotation, value, prefix=path + ".")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(path, value, inner[0])
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            _fail(path, value, "must be a list")
        return tuple(_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            _fail(path, value, "must be a mapping")
        return dict(value)
    if annotation is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            _fail(path, value, "must be true or false")
        return value
    if annotation is int:
        if isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                _fail(path, value, "must be an integer")
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            _fail(path, value, "must be an integer")
        return value
    if annotation is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                _fail(path, value, "must be a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, value, "must be a number")
        if not math.isfinite(value):
            _fail(path, value, "must be a finite number (nan and inf are never valid settings)")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            _fail(path, value, "must be a string")
        return value
    return value


def from_dict(cls, data: dict[str, Any], prefix: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys are errors listing the known ones."""
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        _fail(prefix + unknown[0], data[unknown[0]], f"unknown key; known keys are {sorted(types)}")
    kwargs = {k: _coerce(prefix + k, v, types[k]) for k, v in data.items()}
    return cls(**kwargs)


def _parse_override_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


OVERRIDE_USAGE = "key=value, e.g. model.index_topk=64"


def _parse_override(item: str, sections: tuple[str, ...] | None, usage: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as a YAML scalar or list)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    inside = sections is None or (len(parts) > 1 and parts[0] in sections)
    if not sep or not all(parts) or not inside:
        raise ConfigError(f"argument {item!r} is invalid: expected {usage}")
    return parts, _parse_override_value(text)


def _assign(root: dict, parts: list[str], value: Any) -> None:
    node = root
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            _fail(".".join(parts), value, f"'{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(items: list[str], *, sections: tuple[str, ...] | None = None,
                    usage: str = OVERRIDE_USAGE) -> dict[str, Any]:
    """The one parser of every subcommand's `a.b.c=value` arguments: a nested mapping of the values. With
    `sections`, every key must lie inside one of them (`mesh.fsdp=8`); `usage` is what a malformed item is
    told to look like."""
    nested: dict[str, Any] = {}
    for item in items:
        _assign(nested, *_parse_override(item, sections, usage))
    return nested


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of the nested mapping `data` with each `a.b.c=value` override set in turn."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        _assign(data, *_parse_override(item, None, OVERRIDE_USAGE))
    return data


def _parse_yaml_file(path: Path) -> Any:
    """The file's YAML value; a syntax error names the file, line and column (not "<unicode string>")."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(p) for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p)
        opened = getattr(err, "context_mark", None)
        if opened is not None and mark is not opened:
            problem += f" (the construct opened at line {opened.line + 1}, column {opened.column + 1})"
        raise ConfigError(f"{where}: YAML syntax error: {problem or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a UTF-8 text file ({err})") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        _fail("config", str(path), "file not found")
    data = _parse_yaml_file(path)
    if data is None:
        # An empty file would otherwise mean "all defaults": the 744B model on the whole stdlib corpus.
        raise ConfigError(f"{path}: the config file is empty; it needs at least a model: section "
                          "(see configs/tiny.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {data!r}")
    base = data.pop("base", None)
    if base is not None:
        merged = load_yaml(path.parent / base)
        _deep_update(merged, data)
        data = merged
    return data


def _deep_update(target: dict, source: dict) -> None:
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    return from_dict(ModelConfig, data, prefix="model.").validate()


def load_model_config(path: str | Path, overrides: list[str] | None = None) -> ModelConfig:
    """Load a YAML file whose `model:` section (or whole body) holds ModelConfig fields."""
    data = load_yaml(path)
    section = data.get("model", data) if isinstance(data.get("model"), dict) else data
    section = apply_overrides(section, [o[len("model."):] if o.startswith("model.") else o
                                        for o in (overrides or [])])
    return model_config_from_dict(section)


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """Map a transformers `GlmMoeDsaConfig` (or its dict) onto ModelConfig."""
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        _fail("rope_parameters.rope_type", rope.get("rope_type"), "only default RoPE is supported")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: d[k] for k in names if k in d and d[k] is not None}
    kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 1e6)))
    types = kwargs.get("indexer_types")
    kwargs["indexer_types"] = None if types is None or all(t == "full" for t in types) else tuple(types)
    kwargs.setdefault("num_nextn_predict_layers", 0)
    if kwargs["num_nextn_predict_layers"] == 0:
        kwargs["mtp_num_steps"] = 0
    return ModelConfig(**kwargs).validate()


def to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)
