"""Training losses. Each returns (weighted_sum, denominator) so gradient accumulation over microbatches and
reduction across hosts stay exact: the objective is sum(weighted sums) / sum(denominators).

Token alignment: position t predicts token t+1 of the same packed segment; `loss_mask[t+1]` says whether
token t+1 is a training target (assistant tokens in SFT, every real token in pre-training).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from glm5_jax.distributed.batch_local import context_split
from glm5_jax.model.mtp import shift_within_segment
from glm5_jax.model.token_logprobs import token_logprobs

LossTerms = tuple[jax.Array, jax.Array]


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array, loss_mask: jax.Array,
                       shift: int = 1) -> tuple[jax.Array, jax.Array]:
    """Targets t_{i+shift} and a float weight that is 1 where that target exists in i's segment and has loss."""
    targets, valid = shift_within_segment(tokens, segment_ids, shift)
    shifted_mask, _ = shift_within_segment(loss_mask.astype(jnp.int32), segment_ids, shift)
    return targets, (valid & (shifted_mask > 0)).astype(jnp.float32)


def cross_entropy(hidden: jax.Array, lm_head_kernel: jax.Array, tokens: jax.Array, segment_ids: jax.Array,
                  loss_mask: jax.Array, vocab_chunk: int = 8192, mesh=None) -> LossTerms:
    """Next-token cross-entropy in fp32 over vocabulary chunks (full logits never materialised)."""
    targets, weight = next_token_targets(tokens, segment_ids, loss_mask)
    logp, _ = token_logprobs(hidden, lm_head_kernel, targets, vocab_chunk=vocab_chunk, mesh=mesh)
    return -(logp * weight).sum(), weight.sum()


def mtp_cross_entropy(mtp_hidden: jax.Array, lm_head_kernel: jax.Array, tokens: jax.Array,
                      segment_ids: jax.Array, loss_mask: jax.Array, vocab_chunk: int = 8192,
                      mesh=None) -> LossTerms:
    """MTP loss over D shared steps: depth k (1-based) predicts t_{i+k+1}. Summed over depths; the
    denominator counts every depth's targets, so the mean equals (1/D) sum_k CE_k when depths have equal
    target counts. The weight lambda is applied by the caller."""
    depth = mtp_hidden.shape[0]
    targets, weight = jax.vmap(lambda k: next_token_targets(tokens, segment_ids, loss_mask, shift=k))(
        jnp.arange(2, depth + 2))
    # Depths join the sequence, [D, B, S] -> [B, D*S]: the (sharded) batch dim stays leading, so every device
    # computes the loss of its own rows only ([D*B] would mix batch shards). Under a `context` split that would
    # interleave the sequence's shares, so there depths join the batch as its minor part, [B*D, S]. Both hold
    # the tokens in the same order, but XLA sums over them in another order: [B, D*S] wherever it works keeps
    # the loss bit-exact with runs (and checkpoints) made before the split existed.
    layout = "(b d) s" if context_split(mesh) > 1 else "b (d s)"
    flat = lambda a: rearrange(a, f"d b s ... -> {layout} ...")  # noqa: E731
    logp, _ = token_logprobs(flat(mtp_hidden), lm_head_kernel, flat(targets), vocab_chunk=vocab_chunk, mesh=mesh)
    weight = flat(weight)
    return -(logp * weight).sum(), weight.sum()


def balance_loss(aux: dict) -> LossTerms:
    """Sequence-wise balance loss sum_i f_i P_i, summed over MoE layers, averaged over rows (alpha by caller)."""
    terms = aux["balance_terms"]  # [L_moe, B]
    return terms.sum(), jnp.float32(terms.shape[-1])


def indexer_kl(aux: dict) -> LossTerms:
    """Mean over real tokens and layers of KL(attention target || indexer distribution)."""
    return aux["indexer_kl_sum"].sum(), aux["indexer_kl_count"].sum()
