"""Per-token log-probabilities of the LM head, computed over vocabulary chunks.

The single place where chunked logprobs live: the cross-entropy loss, the RL losses and generation all call
`token_logprobs` so the numbers the rollout engine records and the numbers the trainer recomputes agree.

Logits are `z = (hidden @ kernel) / temperature` in fp32. The vocabulary is visited in chunks of
`vocab_chunk` columns with `lax.scan`, keeping a running max, a running sum of `exp(z - max)` and (for the
entropy) a running sum of `exp(z - max) * z`; the full [B, S, V] logits never exist at once. A hand-written
VJP recomputes each chunk's logits in the backward pass, so autodiff does not store them either; the kernel
gradient comes back chunk by chunk and is assembled once.

When V is not a multiple of the chunk, the last chunk starts at `V - vocab_chunk` (it overlaps the previous
one) and the columns already visited are masked out, so the kernel is never padded or copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.distributed.logical_axes import constrain
from pallas_kernels import NEG_INF


LOGIT_AXES = ("batch", "seq", "vocab")


def _concrete(x):
    """`x` as a numpy array when its value is known (not traced), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _chunk_layout(vocab_size: int, vocab_chunk: int) -> tuple[int, int]:
    chunk = min(vocab_chunk, vocab_size)
    return chunk, -(-vocab_size // chunk)


def _chunk_logits(hidden, kernel, inv_temperature, index, chunk, mesh):
    """Logits of chunk `index` in fp32 and a mask of its columns not visited by an earlier chunk."""
    vocab_size = kernel.shape[1]
    start = jnp.minimum(index * chunk, vocab_size - chunk)
    kernel_chunk = jax.lax.dynamic_slice_in_dim(kernel, start, chunk, axis=1)
    logits = jnp.einsum("BSD,DV->BSV", hidden, kernel_chunk, preferred_element_type=jnp.float32)
    # Logits stay where their tokens are (the kernel chunk is gathered to them): left to itself, GSPMD may
    # gather the tokens of a split sequence to the kernel's shards instead, every chip computing them all.
    logits = constrain(logits, LOGIT_AXES, mesh)
    logits = logits * inv_temperature[:, None, None]
    columns = start + jnp.arange(chunk)
    fresh = columns >= index * chunk
    return jnp.where(fresh, logits, NEG_INF), columns, fresh, kernel_chunk


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _vocab_stats(hidden, kernel, targets, inv_temperature, vocab_chunk, mesh):
    """(target logit, logsumexp, entropy), each [B, S] fp32, of the tempered logits."""
    return _vocab_stats_fwd(hidden, kernel, targets, inv_temperature, vocab_chunk, mesh)[0]


def _vocab_stats_fwd(hidden, kernel, targets, inv_temperature, vocab_chunk, mesh):
    chunk, num_chunks = _chunk_layout(kernel.shape[1], vocab_chunk)
    zeros = jnp.zeros(targets.shape, jnp.float32)

    def visit(carry, index):
        running_max, sum_exp, sum_exp_logit, target_logit = carry
        logits, columns, fresh, _ = _chunk_logits(hidden, kernel, inv_temperature, index, chunk, mesh)
        new_max = jnp.maximum(running_max, logits.max(-1))
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.exp(logits - new_max[..., None])
        sum_exp = sum_exp * rescale + weights.sum(-1)
        sum_exp_logit = sum_exp_logit * rescale + (weights * logits).sum(-1)
        is_target = (columns == targets[..., None]) & fresh
        target_logit = target_logit + jnp.where(is_target, logits, 0.0).sum(-1)
        return (new_max, sum_exp, sum_exp_logit, target_logit), None

    init = (jnp.full(targets.shape, NEG_INF, jnp.float32), zeros, zeros, zeros)
    (running_max, sum_exp, sum_exp_logit, target_logit), _ = jax.lax.scan(visit, init, jnp.arange(num_chunks))
    logsumexp = running_max + jnp.log(sum_exp)
    entropy = logsumexp - sum_exp_logit / sum_exp
    residuals = (hidden, kernel, targets, inv_temperature, logsumexp, entropy)
    return (target_logit, logsumexp, entropy), residuals


def _vocab_stats_bwd(vocab_chunk, mesh, residuals, cotangents):
    hidden, kernel, targets, inv_temperature, logsumexp, entropy = residuals
    d_target, d_logsumexp, d_entropy = cotangents
    chunk, num_chunks = _chunk_layout(kernel.shape[1], vocab_chunk)
    mean_logit = logsumexp - entropy

    def visit(d_hidden, index):
        logits, columns, fresh, kernel_chunk = _chunk_logits(hidden, kernel, inv_temperature, index, chunk, mesh)
        probs = jnp.exp(logits - logsumexp[..., None])
        is_target = (columns == targets[..., None]) & fresh
        # d lse/dz = p;  d H/dz = -p (z - E_p[z]);  d z_target/dz = onehot.
        d_logits = (d_logsumexp[..., None] * probs
                    - d_entropy[..., None] * probs * (logits - mean_logit[..., None])
                    + jnp.where(is_target, d_target[..., None], 0.0))
        d_logits = jnp.where(fresh, d_logits, 0.0) * inv_temperature[:, None, None]
        d_hidden = d_hidden + jnp.einsum("BSV,DV->BSD", d_logits, kernel_chunk.astype(jnp.float32))
        d_kernel_chunk = constrain(jnp.einsum("BSD,BSV->DV", hidden.astype(jnp.float32), d_logits),
                                   ("embed", "vocab"), mesh)
        return d_hidden, d_kernel_chunk

    d_hidden, d_kernel_chunks = jax.lax.scan(visit, jnp.zeros(hidden.shape, jnp.float32), jnp.arange(num_chunks))
    d_kernel = jnp.moveaxis(d_kernel_chunks, 0, 1)  # [D, num_chunks, chunk]
    vocab_size = kernel.shape[1]
    full = d_kernel[:, :-1].reshape(kernel.shape[0], -1)
    tail = d_kernel[:, -1, chunk - (vocab_size - (num_chunks - 1) * chunk):]
    d_kernel = jnp.concatenate([full, tail], axis=1)
    return d_hidden.astype(hidden.dtype), d_kernel.astype(kernel.dtype), None, None


_vocab_stats.defvjp(_vocab_stats_fwd, _vocab_stats_bwd)


def _validate(hidden, kernel, targets, temperature, vocab_chunk):
    if hidden.ndim != 3:
        raise ValueError(f"hidden has shape {hidden.shape}; expected [B, S, D]")
    if kernel.ndim != 2 or kernel.shape[0] != hidden.shape[2]:
        raise ValueError(f"lm_head_kernel has shape {kernel.shape}; expected [D, V] with D = {hidden.shape[2]}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets has shape {targets.shape}; expected [B, S] = {hidden.shape[:2]}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets has dtype {targets.dtype}; expected an integer dtype")
    ids = _concrete(targets)
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= kernel.shape[1]):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"targets contains id {bad}; valid ids are 0..{kernel.shape[1] - 1}")
    if isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, int) or vocab_chunk <= 0:
        raise ValueError(f"vocab_chunk={vocab_chunk!r} is invalid: must be a positive integer")
    temperature = jnp.asarray(temperature)
    if temperature.shape not in ((), (hidden.shape[0],)):
        raise ValueError(f"temperature has shape {temperature.shape}; expected a scalar or [B] = "
                         f"({hidden.shape[0]},)")
    values = _concrete(temperature)
    if values is not None and not (np.all(np.isfinite(values)) and np.all(values > 0)):
        raise ValueError(f"temperature={values!r} is invalid: every temperature must be finite and > 0")
    return jnp.broadcast_to(1.0 / temperature.astype(jnp.float32), (hidden.shape[0],))


def token_logprobs(hidden, lm_head_kernel, targets, *, temperature=1.0, vocab_chunk: int = 8192,
                   compute_entropy: bool = False, mesh=None):
    """log softmax((hidden @ lm_head_kernel) / temperature) at `targets`, in fp32, over vocabulary chunks.

    hidden [B, S, D] (any float dtype), lm_head_kernel [D, V], targets [B, S] int, temperature a scalar or
    [B] (one sampling temperature per sample). Returns (logp [B, S] fp32, entropy [B, S] fp32 or None);
    both are differentiable w.r.t. hidden and the kernel. `mesh` (or the one set by `jax.set_mesh`): where the
    tokens are split; each device then computes its own tokens' logits.
    """
    inv_temperature = _validate(hidden, lm_head_kernel, targets, temperature, vocab_chunk)
    target_logit, logsumexp, entropy = _vocab_stats(hidden, lm_head_kernel, targets, inv_temperature,
                                                    vocab_chunk, mesh)
    return target_logit - logsumexp, (entropy if compute_entropy else None)
