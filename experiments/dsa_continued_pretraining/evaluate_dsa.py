"""Held-out LM loss of each stage's parameters at a chosen index_topk, the training curves' summary, and the
attention FLOPs DSA saves; prints and writes one JSON summary.

    python experiments/dsa_continued_pretraining/evaluate_dsa.py OUT.json NAME=RUN_DIR@TOPK ... [--batches 4]

Every entry is evaluated on the same batches of the stdlib validation split (files never trained on), with
the run's own model config except index_topk. TOPK >= seq_len is dense attention; below it the indexer of
those parameters picks each query's keys. The runner reports eval_loss for pretrain/sft runs only, so the
DSA stages are evaluated here, the same way for every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import yaml

from glm5_jax.config import load_model_config
from glm5_jax.config.experiment import experiment_from_dict
from glm5_jax.model.flops import attention_flops_per_token
from glm5_jax.model.transformer import init
from glm5_jax.runner import MeshLayout, build_tokenizer, evaluate, load_params


def held_out_loss(run_dir: Path, topk: int, batches: int) -> float:
    cfg = experiment_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, index_topk=topk),
                              train=dataclasses.replace(cfg.train, eval_batches=batches))
    params = load_params(run_dir, init(cfg.model, jax.random.key(0)))
    return evaluate(cfg, params, build_tokenizer(cfg), MeshLayout(cfg))


def curve_summary(run_dir: Path, keys: tuple[str, ...], window: int = 5) -> dict:
    """First and last `window`-step means of each metric in the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {"steps": len(rows)}
    for key in keys:
        values = np.array([row[key] for row in rows if key in row], np.float64)
        if len(values):
            out[key] = {"first": round(float(values[:window].mean()), 4),
                        "last": round(float(values[-window:].mean()), 4)}
    return out


def flops_saved(config_path: str, seq_lens: list[int], topk: int | None = None) -> list[dict]:
    config = load_model_config(config_path)
    if topk is not None:
        config = dataclasses.replace(config, index_topk=topk)
    # Both counts include the indexer (it runs in either mode here); a dense MLA model has none at all.
    without_indexer = dataclasses.replace(config, index_n_heads=0, index_head_dim=0)
    rows = []
    for seq_len in seq_lens:
        dense = attention_flops_per_token(config, seq_len, sparse=False)
        sparse = attention_flops_per_token(config, seq_len, sparse=True)
        mla = attention_flops_per_token(without_indexer, seq_len, sparse=False)
        rows.append({"config": config_path, "index_topk": config.index_topk, "seq_len": seq_len,
                     "dense_attention_flops_per_token": dense, "dsa_attention_flops_per_token": sparse,
                     "dense_mla_without_indexer_flops_per_token": mla,
                     "dense_over_dsa": round(dense / sparse, 3), "mla_over_dsa": round(mla / sparse, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("entries", nargs="+", help="NAME=RUN_DIR@TOPK")
    parser.add_argument("--batches", type=int, default=4, help="validation batches per entry")
    args = parser.parse_args()
    evals = {}
    for entry in args.entries:
        name, spec = entry.split("=", 1)
        run_dir, topk = spec.rsplit("@", 1)
        evals[name] = {"run_dir": run_dir, "index_topk": int(topk),
                       "eval_loss": round(held_out_loss(Path(run_dir), int(topk), args.batches), 4)}
    runs = {Path(e["run_dir"]).name: Path(e["run_dir"]) for e in evals.values()}
    curves = {name: curve_summary(path, ("loss", "lm_loss", "indexer_kl", "topk_attention_mass"))
              for name, path in runs.items()}
    flops = (flops_saved("configs/dsa_sparse.yaml", [512])
             + flops_saved("configs/glm5_744b.yaml", [4096, 32768, 131072, 202752]))
    summary = {"eval": evals, "curves": curves, "attention_flops": flops}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
