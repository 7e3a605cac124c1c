"""Why greedy decoding of a randomly initialised model differs between glm5_jax and HF: boundary ties.

On the decode benchmark's model (`small`, index_topk 256, random init, weights exported to HF) and prompts,
one forward of each side over the prompts. Per layer it counts the query rows whose top-k key sets differ,
and in each layer's HF index scores the rows whose k-th and (k+1)-th visible scores tie (ReLU makes many
scores exactly 0; `jax.lax.top_k` and `torch.topk` keep different tied keys, SPEC 2.2.6). If every differing
row of the first indexer layer is a tie row, the two sides compute the same function and differ only in
which tied key they keep; later layers then differ wherever an earlier difference reaches them.

  PYTHONPATH=. python benchmarks/topk_ties_vs_hf.py [--prompt-len 1024] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def differing_rows(ours: np.ndarray, theirs: np.ndarray) -> set[tuple[int, int]]:
    """(batch, query) rows whose selected key sets differ; HF also lists masked (future) keys, dropped here."""
    rows = set()
    for b in range(ours.shape[0]):
        for s in range(ours.shape[1]):
            if {int(i) for i in ours[b, s] if i >= 0} != {int(i) for i in theirs[b, s] if i <= s}:
                rows.add((b, s))
    return rows


def tie_rows(scores: np.ndarray, topk: int, rel_gap: float = 1e-4) -> set[tuple[int, int]]:
    """Rows with more than k visible keys whose k-th and (k+1)-th scores are (nearly) equal."""
    ordered = -np.sort(-scores, axis=-1)
    kth, next_ = ordered[..., topk - 1], ordered[..., topk]
    tied = (next_ > -1e30) & (np.abs(kth - next_) <= rel_gap * np.maximum(np.abs(kth), 1e-6))
    return {tuple(x) for x in np.argwhere(tied).tolist()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("prompt_len", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")

    import jax
    import jax.numpy as jnp
    import torch
    from hf_reference import hf_index_scores, hf_topk_indices

    from benchmarks.decode_vs_hf import model_config, random_prompts
    from benchmarks.hf_reference import export_weights, load_model
    from glm5_jax.model.transformer import FORWARD_STATIC_ARGNAMES, forward, init

    config = model_config(args.prompt_len)
    params = init(config, jax.random.key(args.seed))
    prompts = random_prompts(config.vocab_size, args.batch, args.prompt_len, args.seed + 1)
    jitted = jax.jit(forward, static_argnames=FORWARD_STATIC_ARGNAMES)
    out = jitted(params, jnp.asarray(prompts), config=config, collect_routing=True)
    with tempfile.TemporaryDirectory() as directory:
        export_weights(jax.device_get(params), config, directory)
        model = load_model(directory, "eager", 2)
    with torch.no_grad():
        hf_logits = model(torch.as_tensor(prompts, dtype=torch.long)).logits.numpy()
    _, hf_topk = hf_topk_indices(model, prompts)
    scores = hf_index_scores(model, prompts)
    ours = np.asarray(out.aux["topk"])
    layers = []
    for layer in range(ours.shape[0]):
        differ, ties = differing_rows(ours[layer], hf_topk[layer]), tie_rows(scores[layer], config.index_topk)
        layers.append({"layer": layer, "rows_with_different_topk": len(differ), "rows_with_boundary_ties": len(ties),
                       "different_rows_that_are_tie_rows": len(differ & ties)})
    first = layers[0]
    logit_diff = np.abs(np.asarray(out.logits) - hf_logits).max(-1)
    print(json.dumps({
        "benchmark": "topk_ties_vs_hf", "prompt_len": args.prompt_len, "batch": args.batch,
        "index_topk": config.index_topk, "layers": layers,
        "first_layer_differences_all_at_ties": first["rows_with_different_topk"] == first["different_rows_that_are_tie_rows"],
        "logits_max_abs_diff_rows_without_pruning": float(logit_diff[:, :config.index_topk].max()),
        "logits_max_abs_diff_all_rows": float(logit_diff.max())}))


if __name__ == "__main__":
    main()
