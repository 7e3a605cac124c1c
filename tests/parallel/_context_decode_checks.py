"""Prefill and decode with each sequence and the cache split over `context`, on 8 fake CPU devices; run by
tests/parallel/test_context_decode.py in one subprocess (the device-count flag must be set before jax is
imported; the rest of the suite keeps one device).

Greedy generation on each mesh must give one device's tokens, logits (1e-5), recorded logprobs and indexer
selections, for right-padded prompts of different lengths longer than the indexer's top-k (so DSA's selection
is sparse and the decode's candidates merge from several chips), and the cache must be split over `context`
on its slot dim, before and after decoding, with a decode step that gathers no cache slot. MTP speculative
decoding must give one device's tokens and logits too. The model has every kind of layer tiny.yaml has (dense,
MoE) and an IndexShare layer that reuses the previous top-k.

Usage: python tests/parallel/_context_decode_checks.py. Every check prints "PASS <name>"; a failure exits
non-zero.
"""

import sys

import _eight_devices  # noqa: F401  (the device count, before jax is imported)

import dataclasses  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm5_jax.config import load_model_config  # noqa: E402
from glm5_jax.config.mesh import CONTEXT_AXIS, MeshConfig  # noqa: E402
from glm5_jax.distributed.mesh import make_mesh  # noqa: E402
from glm5_jax.generation import SamplingParams, generate, speculative_generate  # noqa: E402
from glm5_jax.generation.decode import decode_step, prefill  # noqa: E402
from glm5_jax.generation.sampling import split_sampling  # noqa: E402
from glm5_jax.model.transformer import init  # noqa: E402
from glm5_jax.parallel.sharding import shard_params  # noqa: E402

MESHES = [dict(context=2), dict(context=8), dict(fsdp=2, context=4)]
# MTP speculative decoding with one draft: its 2-token verify and MTP extensions are whole on every chip at
# context 4 (per-share merges, as in decode); the MTP prefill is split like the prompt. One mesh: the budget.
SPECULATIVE_MESHES = [dict(fsdp=2, context=4)]
NUM_DRAFT = 1
PROMPT_LENGTHS = (29, 21)   # > index_topk (8); 29 is no multiple of any split: the generator pads the prompt
MAX_NEW = 5
MAX_LEN = 40                # a multiple of every split; 5 slots per chip at context 8 (room for the draft)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


def model_config():
    # tiny.yaml (a dense layer, then MoE layers) with its second layer sharing the first one's top-k.
    return dataclasses.replace(load_model_config(REPO / "configs" / "tiny.yaml"),
                               indexer_types=("full", "shared", "full")).validate()


def mesh_of(sizes: dict):
    cfg = MeshConfig(**sizes)
    return make_mesh(cfg, jax.devices()[:cfg.num_devices])


def run(params, config, prompts, mesh):
    return generate(params, prompts, config=config, sampling=GREEDY, max_len=MAX_LEN, collect_routing=True,
                    return_logits=True, mesh=mesh)


def run_speculative(params, config, prompts, mesh):
    return speculative_generate(params, prompts, config=config, sampling=GREEDY, num_draft=NUM_DRAFT,
                                max_len=MAX_LEN, return_logits=True, mesh=mesh)


def check_same_generation(got, want, label) -> None:
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"{label} tokens")
    np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=f"{label} lengths")
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5 * np.abs(want.logits).max(),
                               err_msg=f"{label} logits")
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5, err_msg=f"{label} logprobs")


def check_cache_split(params, config, prompts, mesh, sizes) -> None:
    """The cache arrays are split over `context` on their slot dim after prefill and after a decode step: each
    device holds MAX_LEN / context slots of every row it holds."""
    nucleus, values = split_sampling(GREEDY)
    split = sizes["context"]
    fed = np.zeros((len(prompts), -(-max(PROMPT_LENGTHS) // split) * split), np.int32)
    for row, prompt in enumerate(prompts):
        fed[row, :len(prompt)] = prompt
    state, _ = prefill(params, jnp.asarray(fed), jnp.asarray(PROMPT_LENGTHS, jnp.int32), jax.random.key(0), values,
                       config=config, nucleus=nucleus, max_len=MAX_LEN, max_new_tokens=MAX_NEW, collect_routing=True,
                       return_logits=True, mesh=mesh)  # generate's arguments: its compiled steps are reused
    for when in ("prefill", "decode"):
        for name, array in state.cache._asdict().items():
            spec = array.sharding.spec
            assert len(spec) > 2 and spec[2] == CONTEXT_AXIS, f"{name} after {when} on {sizes}: spec {spec}"
            shard_slots = {shard.data.shape[2] for shard in array.addressable_shards}
            assert shard_slots == {MAX_LEN // split}, f"{name} after {when} on {sizes}: shards hold {shard_slots}"
        if when == "prefill":
            if split == max(m["context"] for m in MESHES):  # one extra compile: the decode step's program
                check_decode_collectives(decode_step.lower(params, state, values, config=config, nucleus=nucleus,
                                                           mesh=mesh).compile().as_text(), sizes)
            state = decode_step(params, state, values, config=config, nucleus=nucleus, mesh=mesh)
    print(f"PASS cache split on {sizes}: latent and indexer keys hold {MAX_LEN // split} of {MAX_LEN} slots per "
          "device after prefill and decode")


def check_decode_collectives(hlo: str, sizes) -> None:
    """A decode step gathers only per-new-token arrays [B, 1, ...] (the chips' top-k candidates): no chip
    gathers cache slots. Its merges (attention by log-sum-exp) are all-reduces."""
    gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
    assert gathered, f"decode on {sizes}: no all-gather at all, so the top-k candidates were not merged"
    shapes = [tuple(int(d) for d in dims.split(",")) for dims in gathered]
    assert all(len(shape) >= 2 and shape[1] == 1 for shape in shapes), f"decode on {sizes} gathers {shapes}"
    assert re.search(r"all-reduce\(", hlo), f"decode on {sizes}: no all-reduce merges the attention"
    print(f"PASS decode collectives on {sizes}: all-gathers only of per-token candidates {sorted(set(shapes))}")


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    config = model_config()
    assert min(PROMPT_LENGTHS) > config.index_topk
    params = jax.device_get(jax.jit(lambda key: init(config, key))(jax.random.key(0)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    want = run(params, config, prompts, None)
    assert (want.lengths == MAX_NEW).all(), want.lengths
    # The decode steps' selections are sparse and reach past the first chip's slots at every split.
    decoded = np.stack([want.indexer_topk[row, :, n:n + MAX_NEW - 1] for row, n in enumerate(PROMPT_LENGTHS)])
    assert (decoded >= 0).all() and (decoded >= MAX_LEN // 2).any() and (decoded < MAX_LEN // 8).any(), \
        "the decoded tokens' top-k does not exercise the split"
    want_speculative = run_speculative(params, config, prompts, None)
    # Greedy drafting changes no token. Random weights' drafts are rejected: every verify writes a draft row that
    # the next step overwrites (the rollback), on whichever chip owns its slot.
    np.testing.assert_array_equal(want_speculative.tokens, want.tokens)
    for sizes in MESHES:
        mesh = mesh_of(sizes)
        mesh_params = shard_params(params, mesh, config=config)
        got = run(mesh_params, config, prompts, mesh)
        label = f"greedy generation on {sizes}"
        check_same_generation(got, want, label)
        for row, length in enumerate(PROMPT_LENGTHS):  # every fed position's selections
            fed = length + MAX_NEW - 1
            np.testing.assert_array_equal(got.indexer_topk[row, :, :fed], want.indexer_topk[row, :, :fed],
                                          err_msg=f"{label} indexer top-k of row {row}")
        print(f"PASS {label}: tokens, top-k selections and logits (max diff "
              f"{np.abs(got.logits - want.logits).max():.2e}) equal one device's")
        check_cache_split(mesh_params, config, prompts, mesh, sizes)
        if sizes in SPECULATIVE_MESHES:
            got = run_speculative(mesh_params, config, prompts, mesh)
            label = f"speculative generation on {sizes}"
            check_same_generation(got, want_speculative, label)
            assert got.acceptance_length == want_speculative.acceptance_length, label
            print(f"PASS {label}: tokens and logits equal one device's (acceptance length "
                  f"{got.acceptance_length:.2f} with {NUM_DRAFT} draft)")


if __name__ == "__main__":
    main()
