"""Remat policies that keep parts of DSA's forward pass (`config.REMAT_POLICIES`): they change only what the
backward pass recomputes, never a value, and they keep what they say. `full_keep_dsa_target` keeps the sparse
stage's KL target (so on GPU the backward does not re-run the target kernel's row gathers; on TPU the target comes
from the forward kernel, which the backward re-runs anyway); `full_keep_attention` also keeps the sparse MLA forward
kernel's outputs, its custom VJP's residuals (so the backward does not re-run the forward kernel);
`full_keep_projections` keeps the target and the small projections' outputs (the attention's down-projections, the
MLPs' gate and up), so the backward re-runs none of those matmuls. The kernels' calls (and matmuls) are counted in
the gradient's jaxpr as it is traced for a TPU (Mosaic)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax._src.interpreters import partial_eval as pe
from jax.ad_checkpoint import print_saved_residuals
from pallas_model import small_pallas_model

from glm5_jax.config import ConfigError
from glm5_jax.config.core import ATTENTION_FORWARD_KERNELS
from glm5_jax.model.transformer import forward, init

CONFIG = small_pallas_model(compute_dtype="float32", moe_backend="ragged")
SEQ = 12
KEEP_POLICIES = ("full_keep_dsa_target", "full_keep_attention")
# Policies that must give `full`'s values: the keep policies and the one that keeps less.
SAME_VALUE_POLICIES = (*KEEP_POLICIES, "full_keep_projections", "full_without_topk_scores")


def _loss(params, tokens, config):
    out = forward(params, tokens, config=config, indexer_mode="sparse")
    return jnp.mean(out.logits**2) + jnp.mean(out.mtp_logits**2) + out.aux["indexer_kl_sum"].sum()


def _kernel_calls(jaxpr, counter=None):
    """Pallas kernel calls in a jaxpr and every jaxpr inside it, by kernel function name, and its matmuls (under
    "dot_general")."""
    counter = collections.Counter() if counter is None else counter
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counter[eqn.params["jaxpr"].debug_info.func_src_info.split(" at ")[0]] += 1
        elif eqn.primitive.name == "dot_general":
            counter["dot_general"] += 1
        for sub in core.jaxprs_in_params(eqn.params):
            _kernel_calls(sub, counter)
    return counter


def _gradient_kernels(policy: str, **overrides) -> collections.Counter:
    """Kernel calls of the loss gradient traced for TPU, after dead-code elimination."""
    config = dataclasses.replace(CONFIG, pallas_platform="tpu", remat_policy=policy, **overrides)
    params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    closed = jax.make_jaxpr(jax.grad(functools.partial(_loss, config=config)))(params, tokens)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return _kernel_calls(jaxpr)


def _saved(policy: str) -> list[str]:
    """The residuals `print_saved_residuals` lists for the gradient under `policy`, traced for TPU."""
    config = dataclasses.replace(CONFIG, pallas_platform="tpu", remat_policy=policy)
    params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        print_saved_residuals(functools.partial(_loss, config=config), params,
                              jax.ShapeDtypeStruct((1, SEQ), jnp.int32))
    # Constants (RoPE's permutation matrix) are part of the program, not activations a policy keeps or drops.
    return [line for line in out.getvalue().splitlines() if "from a constant" not in line]


class _Traced:
    """`_gradient_kernels` and `_saved`, each policy and config traced once for the tests that share this (a
    trace of the gradient with the TPU kernels takes seconds; `full` is every test's reference)."""

    def __init__(self):
        self._kernels, self._residuals = {}, {}

    def kernels(self, policy: str, **overrides) -> collections.Counter:
        return collections.Counter({name: calls for name, calls in self._calls(policy, **overrides).items()
                                    if name != "dot_general"})

    def matmuls(self, policy: str) -> int:
        return self._calls(policy)["dot_general"]

    def _calls(self, policy: str, **overrides) -> collections.Counter:
        key = (policy, tuple(sorted((k, v) for k, v in overrides.items() if getattr(CONFIG, k) != v)))
        if key not in self._kernels:
            self._kernels[key] = _gradient_kernels(policy, **dict(key[1]))
        return collections.Counter(self._kernels[key])

    def residuals(self, policy: str) -> collections.Counter:
        if policy not in self._residuals:
            self._residuals[policy] = _saved(policy)
        return collections.Counter(self._residuals[policy])


@pytest.fixture(scope="module")
def traced() -> _Traced:
    return _Traced()


def _value_and_grad(policy: str):
    """Loss and gradients under `policy`, the kernels run (interpreted on CPU)."""
    params = init(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, SEQ), 0, CONFIG.vocab_size)
    config = dataclasses.replace(CONFIG, remat_policy=policy)
    return jax.jit(jax.value_and_grad(functools.partial(_loss, config=config)))(params, tokens)


@pytest.fixture(scope="module")
def under_full():
    """`full`'s loss and gradients, the reference of every policy below (traced and run once)."""
    return _value_and_grad("full")


@pytest.mark.parametrize("policy", SAME_VALUE_POLICIES)
@pytest.mark.slow
def test_keep_policies_give_the_same_loss_and_gradients_as_full(policy, under_full):
    """The kernels run (interpreted on CPU) under `full` and the policy: loss and every gradient equal."""
    ref_value, ref_grads = under_full
    value, grads = _value_and_grad(policy)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("index_topk, forward_kernel, backward_kernel", [
    (CONFIG.index_topk, "_forward_kernel", "_backward_kernel"),  # T > N: the sparse MLA kernels
    (SEQ, "_flash_forward_kernel", "_flash_dkv_kernel"),  # T <= N: flash attention (its backward one kernel)
])
def test_keep_attention_spares_the_backward_the_forward_kernel(index_topk, forward_kernel, backward_kernel, traced):
    """Under `full` the backward re-runs the attention's forward kernel of every rematerialised layer;
    `full_keep_attention` keeps its outputs, so it runs once per layer, as without remat."""
    none, full, keep = (traced.kernels(p, index_topk=index_topk) for p in ("none", "full", "full_keep_attention"))
    assert full[forward_kernel] > none[forward_kernel] > 0, (full, none)
    assert keep[forward_kernel] == none[forward_kernel], (keep, none)
    assert keep[backward_kernel] == full[backward_kernel] == none[backward_kernel] > 0


@pytest.mark.slow
def test_on_tpu_the_target_is_written_by_the_forward_kernel(traced):
    """No stand-alone target kernel on TPU: the forward kernel writes the KL target, so keeping it
    (`full_keep_dsa_target`) spares no kernel run against `full` (the backward re-runs the forward kernel for its
    residuals either way)."""
    full, keep = (traced.kernels(p) for p in ("full", "full_keep_dsa_target"))
    assert "_target_kernel" not in full and "_target_kernel" not in keep, (full, keep)
    assert full == keep and full["_forward_kernel"] > 0, (full, keep)


def test_keep_policies_save_what_they_name(traced):
    """Residuals the layer stacks keep (stacked over layers by `lax.scan`, [layers, B, S, ...]): the
    `dsa_target` [.., S, N] of each stack's MoE layer under both keep policies; under `full_keep_attention` also
    the forward kernel's output and lse ([.., S, H, C] and [.., S, H, 1], heads and columns padded to the
    kernel's tiles) of every stack (two scanned stacks and the MTP step); nothing more."""
    full, target, attention = (traced.residuals(p) for p in ("full", *KEEP_POLICIES))
    kept_target = list((target - full).elements())
    assert len(kept_target) == 2 and not full - target, (target - full, full - target)
    assert all(line.startswith(f"f32[1,1,{SEQ},{CONFIG.index_topk}] output of scan") for line in kept_target)
    kept_kernel = sorted((attention - target).elements())
    assert len(kept_kernel) == 6 and not target - attention, (attention - target, target - attention)
    shapes = [tuple(int(d) for d in line.split("[")[1].split("]")[0].split(",")) for line in kept_kernel]
    assert all(len(shape) == 5 and shape[:3] == (1, 1, SEQ) and shape[3] >= CONFIG.num_attention_heads
               for shape in shapes), kept_kernel
    assert sorted(shape[4] >= CONFIG.kv_lora_rank for shape in shapes) == [False] * 3 + [True] * 3, kept_kernel


def test_keep_projections_keeps_the_small_projections_and_recomputes_none(traced):
    """Besides the target, each layer stack (dense, MoE) and the MTP step keep q_a's and kv_a's outputs and the
    dense MLP's or shared expert's gate and up outputs, and the backward runs four matmuls fewer in each."""
    target, projections = (traced.residuals(p) for p in ("full_keep_dsa_target", "full_keep_projections"))
    kept = list((projections - target).elements())
    assert not target - projections, target - projections
    widths = sorted(int(line.split("]")[0].split(",")[-1]) for line in kept)
    q, ckv = CONFIG.q_lora_rank, CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim
    dense, shared = CONFIG.intermediate_size, CONFIG.moe_intermediate_size * CONFIG.n_shared_experts
    assert widths == sorted([q, ckv] * 3 + [dense] * 2 + [shared] * 4), kept
    matmuls = {p: traced.matmuls(p) for p in ("full_keep_dsa_target", "full_keep_projections")}
    assert matmuls["full_keep_projections"] == matmuls["full_keep_dsa_target"] - 4 * 3, matmuls


def test_without_topk_scores_keeps_the_selection_only(traced):
    """`full_without_topk_scores` drops the top-k's fp32 scores [.., S, N] from every stack's residuals (and keeps
    the int32 selection), so the backward's recompute runs the top-k kernel again for them."""
    full, lean = (traced.residuals(p) for p in ("full", "full_without_topk_scores"))
    dropped = list((full - lean).elements())
    assert dropped and not lean - full, (full - lean, lean - full)
    assert all(line.startswith(f"f32[1,1,{SEQ},{CONFIG.index_topk}] output of scan") for line in dropped), dropped
    assert any(line.startswith(f"i32[1,1,{SEQ},{CONFIG.index_topk}]") for line in lean), lean
    full_calls, lean_calls = traced.kernels("full"), traced.kernels("full_without_topk_scores")
    more = {name for name in lean_calls if lean_calls[name] > full_calls[name]}
    assert len(more) == 1 and all(lean_calls[n] == full_calls[n] for n in full_calls if n not in more), (
        full_calls, lean_calls)


def test_the_kept_kernels_are_the_attention_forward_kernels():
    """The policy finds the kernels by function and module name: each must exist, so a rename fails here."""
    from pallas_kernels import sparse_mla, tpu_flash_attention, tpu_sparse_mla

    modules = {"sparse_mla.py": sparse_mla, "tpu_sparse_mla.py": tpu_sparse_mla,
               "tpu_flash_attention.py": tpu_flash_attention}
    for name, module_file in ATTENTION_FORWARD_KERNELS:
        module = modules[module_file]
        assert Path(inspect.getsourcefile(getattr(module, name))).name == module_file


@pytest.mark.slow
def test_flash_every_key_false_keeps_the_sparse_mla_kernels(traced):
    """`flash_every_key: false` (for a config whose memory is short) attends over every selected key
    with the sparse MLA kernels, as where T > N; a value that is not a bool is refused by name."""
    flash, sparse = (traced.kernels("none", index_topk=SEQ, flash_every_key=f) for f in (True, False))
    assert flash["_flash_forward_kernel"] > 0 and "_forward_kernel" not in flash, flash
    assert sparse["_forward_kernel"] > 0 and "_flash_forward_kernel" not in sparse, sparse
    with pytest.raises(ConfigError, match="flash_every_key='yes' is invalid: must be true or false"):
        dataclasses.replace(CONFIG, flash_every_key="yes").validate()
