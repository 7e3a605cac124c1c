"""Context parallelism on 8 fake CPU devices, run by tests/parallel/test_context_parallel.py in one subprocess
(the device-count flag must be set before jax is imported; the rest of the suite keeps one device).

Every training objective's loss and gradients with each sequence split over `context` (alone and with `fsdp`
or `expert`) must equal one device's, on packed rows whose documents cross the chips' boundaries, and the
indexer must pick the same keys. The one-device reference of each objective is computed once; the meshes of
a mode share nothing but the parameters and the batch (each mesh is one compile).

Usage: python tests/parallel/_context_checks.py [order | topk | pretrain | dsa_sparse | dsa_warmup | rl | pallas | scaling ...]
(default: all but scaling and pallas). Every check prints "PASS <name>"; a failure exits non-zero.
"""

import sys

import _eight_devices  # noqa: F401  (the device count, before jax is imported)

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm5_jax.config import TrainConfig, load_model_config  # noqa: E402
from glm5_jax.config.mesh import BATCH_AXES, CONTEXT_AXIS, MeshConfig  # noqa: E402
from glm5_jax.distributed.mesh import make_mesh  # noqa: E402
from glm5_jax.distributed.context_local import context_local  # noqa: E402
from glm5_jax.distributed.context_order import to_balanced, to_natural  # noqa: E402
from glm5_jax.model.transformer import forward, init  # noqa: E402
from glm5_jax.parallel.sharding import shard_params  # noqa: E402
from glm5_jax.train.objective import make_objective  # noqa: E402

BATCH, SEQ = 2, 64
# Packed documents per row (lengths; 0 = padding): boundaries fall inside every chip's share at context 8.
DOCUMENTS = ([(20, 1), (30, 2), (14, 3)], [(5, 1), (43, 2), (9, 3), (7, 0)])

# mode -> the meshes it runs on. Each is one compile of the objective's gradient (~5 s of CPU) and the file's
# budget is 60 s, so every mesh of the issue runs in one mode: pretrain (and sft, the same compiled function
# with another loss mask) on the hardest splits, the DSA modes on the others.
MESHES = {
    "pretrain": [dict(context=8), dict(context=2, fsdp=2), dict(context=2, expert=2)],
    "dsa_sparse": [dict(context=4)],
    "dsa_warmup": [dict(context=2)],
    # the RL loss reads per-token logprobs of the final hidden states (no sequence op of its own); the batch
    # replays the one-device indexer top-k, which must land on the same tokens. RL runs attention_backend
    # dense (the expanded form masked to the selection), which no other mode here attends with.
    "rl": [dict(context=4)],
}
TOPK_MESHES = [dict(context=8)]
BATCH_AXES_OF = {2: "fsdp", 4: "fsdp", 8: None}  # the order checks' batch split next to `context`
# The Pallas kernels (interpret mode on CPU) across the split, each chip's queries at their global offset: the
# two DSA modes run every kernel (indexer top-k and scores, sparse MLA forward and backward, both KL targets).
PALLAS_MESHES = {"dsa_sparse": [dict(context=2)], "dsa_warmup": [dict(context=2, fsdp=2)]}
# The indexer KL is a sum of small differences of logs, and its gradients (the indexer's) inherit that: on
# `fsdp` 2 alone (no context split, the batch split that predates it) the KL sum already differs from one
# device's by 5.6e-5 relative and an indexer gradient by 1.1e-5 of its largest entry, so those get 2e-4 and
# 5e-5; everything else is held to 1e-5.
SUM_TOLERANCE = {"indexer_kl": dict(rtol=2e-4)}
# dsa_warmup's loss is that KL alone (the model is frozen): 2.3e-5 relative (1.6e-9 absolute) once the chips'
# queries run in the load-balanced order, which changes the order of the same sum.
LOSS_TOLERANCE = {"dsa_warmup": SUM_TOLERANCE["indexer_kl"]}
GRAD_TOLERANCE = {"dsa_sparse": dict(scaled_atol=5e-5), "dsa_warmup": dict(scaled_atol=5e-5)}


def model_config():
    # tiny.yaml with one dense layer and one MTP depth, whose layer is the MoE one with its own indexer: every
    # kind of layer at the least compile time (the file's CPU budget). The `ep` dispatch serves one device
    # and meshes alike, so one model config compiles for all.
    return dataclasses.replace(load_model_config(REPO / "configs" / "tiny.yaml"), num_hidden_layers=1,
                               mtp_num_steps=1, moe_backend="ep", attention_backend="sparse").validate()


def packed_batch(config, sft: bool) -> dict:
    segment_ids, positions, lengths = (np.zeros((BATCH, SEQ), np.int32) for _ in range(3))
    for row, documents in enumerate(DOCUMENTS):
        start = 0
        for length, segment in documents:
            segment_ids[row, start:start + length] = segment
            positions[row, start:start + length] = np.arange(length)
            lengths[row, start:start + length] = length
            start += length
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, config.vocab_size), np.int32)
    loss_mask = segment_ids > 0
    if sft:  # the first half of each document is its prompt
        loss_mask &= positions >= lengths // 2
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions,
            "loss_mask": loss_mask.astype(np.int32)}


def mesh_of(sizes: dict):
    cfg = MeshConfig(**sizes)
    return make_mesh(cfg, jax.devices()[:cfg.num_devices])


def close(a, b, name, rtol=1e-5, scaled_atol=1e-5):
    """allclose with the absolute tolerance relative to the largest magnitude of the expected values."""
    a, b = np.asarray(a), np.asarray(b)
    atol = scaled_atol * max(float(np.abs(b).max()), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


def rl_batch(config, params, batch: dict) -> dict:
    """An RL batch over the packed rows: targets = the next token within its document, rollout logprobs near
    the model's own, advantages of both signs, and the one-device routing recorded for replay."""
    from glm5_jax.train.rl import ADVANTAGES, ROLLOUT_LOGPROBS

    out = forward(params, batch["tokens"], config=config, positions=batch["positions"],
                  segment_ids=batch["segment_ids"], return_logits=False, mtp_steps=0, collect_routing=True)
    same_document = batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1]
    loss_mask = np.pad(same_document & (batch["segment_ids"][:, 1:] > 0), ((0, 0), (0, 1)))
    rng = np.random.default_rng(0)
    return {**batch, "targets": np.pad(batch["tokens"][:, 1:], ((0, 0), (0, 1))),
            "loss_mask": loss_mask.astype(np.int32),
            ROLLOUT_LOGPROBS: -np.log(config.vocab_size) + rng.normal(0, 0.1, (BATCH, SEQ)).astype(np.float32),
            ADVANTAGES: rng.normal(0, 1, (BATCH, SEQ)).astype(np.float32),
            "temperature": np.ones((BATCH,), np.float32),
            "indexer_topk": np.swapaxes(np.asarray(out.aux["topk"]), 0, 1),
            **({"expert_choices": np.swapaxes(np.asarray(out.aux["expert_ids"]), 0, 1)}
               if "expert_ids" in out.aux else {})}


def gradient_fn(config, mode: str, mesh):
    from glm5_jax.config.rl import RLStepConfig
    from glm5_jax.train.rl import RLConfig

    train = TrainConfig(batch_size=BATCH, seq_len=SEQ, mode=mode, bias_update_rate=0.0).validate()
    rl = RLStepConfig(objective=RLConfig(loss="double_sided_is", eps_low=0.2, eps_high=0.2)) if mode == "rl" \
        else None
    objective = make_objective(config, train, rl, mesh=mesh)

    def value_and_grad(params, batch):
        (value, (sums, _)), grads = jax.value_and_grad(objective, has_aux=True)(
            params, batch, objective.denominators(batch))
        return value, sums, grads

    return jax.jit(value_and_grad)


# The batch fields' dims split over `context`: [B, S, ...] on S, recorded routing [B, L, S, ...] on S, [B] none.
CONTEXT_DIM = {"expert_choices": 2, "indexer_topk": 2, "temperature": None}


def split_batch(batch: dict, mesh) -> dict:
    """Every field split over the batch axes on B and over `context` on its sequence dim."""
    def spec(key, value):
        dim = CONTEXT_DIM.get(key, 1)
        return PartitionSpec(BATCH_AXES, *([None] * (dim - 1) + [CONTEXT_AXIS] if dim else []))
    return {key: jax.device_put(value, NamedSharding(mesh, spec(key, value))) for key, value in batch.items()}


def check_mode(mode: str, config, params, batches: dict, meshes: list[dict] | None = None) -> None:
    if mode == "rl":
        config = dataclasses.replace(config, attention_backend="dense")
    reference = gradient_fn(config, mode, None)
    wants = {name: jax.device_get(reference(params, batch)) for name, batch in batches.items()}
    for sizes in MESHES[mode] if meshes is None else meshes:
        mesh = mesh_of(sizes)
        fn = gradient_fn(config, mode, mesh)
        mesh_params = shard_params(params, mesh, config=config)
        for name, batch in batches.items():
            value, sums, grads = jax.device_get(fn(mesh_params, split_batch(batch, mesh)))
            want_value, want_sums, want_grads = wants[name]
            label = f"{name} ({config.attention_backend}) on {sizes}"
            close(value, want_value, f"{label} loss", **LOSS_TOLERANCE.get(mode, {}))
            for key in want_sums:
                close(sums[key], want_sums[key], f"{label} {key}", **SUM_TOLERANCE.get(key, {}))
            moved = 0
            for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
                close(got, want, f"{label} gradient {jax.tree_util.keystr(path)}", **GRAD_TOLERANCE.get(mode, {}))
                moved += bool(np.abs(want).max() > 0)
            assert moved > 0, f"{label}: every gradient is zero, the comparison would prove nothing"
            print(f"PASS {label}: loss {float(value):.6f} and {moved} nonzero gradients equal one device's")


def check_topk(config, params, batch) -> None:
    """The indexer's selections (every layer's global key indices) on a split sequence equal one device's."""
    def selections(mesh):
        return jax.jit(lambda p, b: forward(p, b["tokens"], config=config, positions=b["positions"],
                                            segment_ids=b["segment_ids"], return_logits=False, mtp_steps=0,
                                            collect_routing=True, mesh=mesh).aux["topk"])

    want = np.asarray(selections(None)(params, batch))
    assert (want >= SEQ // 2).any(), "no query selected a key in the second half: the split is not exercised"
    for sizes in TOPK_MESHES:
        mesh = mesh_of(sizes)
        got = np.asarray(selections(mesh)(shard_params(params, mesh, config=config), split_batch(batch, mesh)))
        np.testing.assert_array_equal(got, want, err_msg=f"top-k on {sizes}")
        print(f"PASS top-k selections on {sizes} equal one device's ({want.shape[0]} layers)")
    # Keys scored in blocks of 24 (not dividing the 64 gathered keys) with a running merge, on every chip.
    config = dataclasses.replace(config, index_key_block=24)
    mesh = mesh_of(TOPK_MESHES[0])
    got = np.asarray(selections(mesh)(shard_params(params, mesh, config=config), split_batch(batch, mesh)))
    np.testing.assert_array_equal(got, want, err_msg=f"top-k over key blocks on {TOPK_MESHES[0]}")
    print(f"PASS top-k over key blocks on {TOPK_MESHES[0]} equals one device's")


def check_order(seq: int = 48) -> None:
    """The load-balanced order: chip c holds natural chunks c and 2 x context - 1 - c, `to_natural` undoes
    `to_balanced` (values and, as its transpose, gradients), and every chip's queries see the same number of
    causal keys through `context_local`, where contiguous shares give the last chip 2 x context - 1 times the
    first's."""
    for sizes in (dict(context=2, fsdp=4), dict(context=4, fsdp=2), dict(context=8)):
        mesh, split = mesh_of(sizes), sizes["context"]
        rows, chunk = 4 if split < 8 else 1, seq // (2 * split)
        natural = np.arange(rows * seq, dtype=np.float32).reshape(rows, seq, 1) * [1.0, -1.0]
        placed = jax.device_put(natural, NamedSharding(mesh, PartitionSpec(BATCH_AXES_OF[split], CONTEXT_AXIS)))
        balanced = np.asarray(jax.jit(lambda x: to_balanced(x, mesh))(placed))
        want = np.concatenate([natural[:, k * chunk:(k + 1) * chunk] for c in range(split)
                               for k in (c, 2 * split - 1 - c)], axis=1)
        np.testing.assert_array_equal(balanced, want, err_msg=f"balanced order on {sizes}")
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: to_natural(to_balanced(x, mesh), mesh))(placed)),
                                      natural, err_msg=f"round trip on {sizes}")
        weights = np.random.default_rng(split).normal(size=natural.shape).astype(np.float32)
        grad = jax.grad(lambda x: (to_balanced(x, mesh) * weights).sum())(placed)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(jax.jit(lambda w: to_natural(w, mesh))(weights)),
                                      err_msg=f"gradient of the balanced order on {sizes}")

        def visible_pairs(q_offset, queries, _keys):  # keys each query may see: its global position + 1
            return jnp.broadcast_to(q_offset + jnp.arange(queries.shape[1]) + 1, queries.shape[:2])

        per_query = np.asarray(jax.jit(lambda x: context_local(visible_pairs, mesh, (x,), (x,)))(placed))
        per_chip = per_query[0].reshape(split, -1).sum(axis=1)
        assert (per_chip == per_chip[0]).all(), f"causal keys per chip on {sizes}: {per_chip}"
        contiguous = (np.arange(seq) + 1).reshape(split, -1).sum(axis=1)
        print(f"PASS balanced order on {sizes}: visible keys per chip {per_chip.tolist()} "
              f"(contiguous shares: {contiguous.tolist()})")


def compiled_step(context: int, seq: int):
    """(per-device matmul FLOPs with every loop trip counted, XLA's temporaries in bytes) of the exact step
    `glm5 train` builds for tiny.yaml with one sequence of `seq` tokens split over `context` chips: compiled
    over ShapeDtypeStructs, never run."""
    from glm5_jax.config.experiment import load_experiment
    from glm5_jax.parallel.aot import abstract_train_step
    from glm5_jax.parallel.hlo_stats import hlo_stats

    cfg = load_experiment(REPO / "configs" / "tiny.yaml", [
        "train.batch_size=1", f"train.seq_len={seq}", "optim.name=adamw", "model.attention_backend=sparse",
        "mesh.fsdp=1", f"mesh.context={context}"])
    jitted, state, batch, _ = abstract_train_step(cfg, jax.devices()[:context])
    compiled = jitted.trace(state, batch).lower().compile()
    return hlo_stats(compiled.as_text(), context).matmul_flops, compiled.memory_analysis().temp_size_in_bytes


def check_scaling(seq: int = 16384, context: int = 4) -> None:
    """Per-device work and activation memory shrink with the split: context 4 does at most 0.3 of one device's
    matmul FLOPs at 16K tokens, and its temporaries fall to match."""
    single_flops, single_temp = compiled_step(1, seq)
    flops, temp = compiled_step(context, seq)
    share, memory_share = flops / single_flops, temp / single_temp
    print(f"context={context} seq={seq}: matmul FLOPs per device {flops:.4g} vs {single_flops:.4g} on one "
          f"(share {share:.3f}); temporaries {temp / 2**20:.1f} MiB vs {single_temp / 2**20:.1f} MiB "
          f"(share {memory_share:.3f})")
    assert share <= 0.3, f"per-device matmul FLOPs are {share:.3f} of one device's at context={context}"
    assert memory_share <= 0.35, f"per-device temporaries are {memory_share:.3f} of one device's"
    print(f"PASS context={context} at {seq} tokens: per-device matmul FLOPs {share:.3f} and temporaries "
          f"{memory_share:.3f} of one device's")


def main(modes: list[str]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    config = model_config()
    params = jax.device_get(jax.jit(lambda key: init(config, key))(jax.random.key(0)))
    lm = {"pretrain": packed_batch(config, sft=False), "sft": packed_batch(config, sft=True)}
    assert (lm["sft"]["loss_mask"] != lm["pretrain"]["loss_mask"]).any()
    for mode in modes:
        if mode == "order":
            check_order()
        elif mode == "topk":
            check_topk(config, params, lm["pretrain"])
        elif mode == "scaling":
            check_scaling()
        elif mode == "pallas":
            kernels = dataclasses.replace(config, attention_backend="pallas")
            for dsa_mode, meshes in PALLAS_MESHES.items():
                check_mode(dsa_mode, kernels, params, {dsa_mode: lm["pretrain"]}, meshes)
        else:
            # pretrain and sft run the same objective; sft differs by its loss mask only, so both batches
            # go through the pretrain objective's compiled gradient.
            batches = lm if mode == "pretrain" else {
                mode: rl_batch(config, params, lm["pretrain"]) if mode == "rl" else lm["pretrain"]}
            check_mode(mode, config, params, batches)


if __name__ == "__main__":
    main(sys.argv[1:] or ["order", "topk", *MESHES])
