"""`glm5 eval SOURCE DATA [key=value ...]`: held-out loss of a model on a data section.

DATA is an experiment YAML (its data: section, and train: seq_len / batch_size / eval_batches; a model:
section must agree with SOURCE), a `.jsonl` file or a directory of them. The model is SOURCE's; every other
setting starts from SOURCE's own run config when it has one. The stdlib source is scored on its validation
split (files never trained on) with the batches `glm5 train`'s end-of-run evaluation uses, so the loss equals
that run's `eval_loss`; files are scored as given. `--mode sft` reads chat records (`data.source=chat_jsonl`)
and scores only their loss-masked (assistant) tokens. The data repeat, so `train.eval_batches` (or
`--batches`) batches are scored.

Reported: the mean next-token loss (nats per scored token), bits per byte with the byte tokenizer (loss /
ln 2: each token is a byte, an end-of-text target counts as one) or perplexity (exp(loss)) with another, and
scored tokens per second after the first batch (which compiles).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

from glm5_jax.commands.source import CommandError, ModelSource
from glm5_jax.config import apply_overrides, load_yaml
from glm5_jax.config.experiment import ExperimentConfig, experiment_from_dict
from glm5_jax.config.init_model import agreeing_model
from glm5_jax.data.tokenizer import ByteTokenizer
from glm5_jax.parallel.trainer import MeshLayout
from glm5_jax.runner import sharded_batches
from glm5_jax.train.held_out import batch_loss_fn

EVAL_MODES = ("pretrain", "sft")


def _data_section(data: str, mode: str) -> tuple[dict, dict, dict | None]:
    """(data section, train settings, model section or None) that DATA names."""
    path = Path(data)
    source = "chat_jsonl" if mode == "sft" else "jsonl"
    if path.is_dir():
        files = sorted(str(f) for f in path.glob("*.jsonl"))
        if not files:
            raise CommandError(f"DATA {data!r} is a directory without .jsonl files")
        return {"source": source, "paths": files}, {}, None
    if not path.is_file():
        raise CommandError(f"DATA {data!r} does not exist: give an experiment YAML, a .jsonl file or a directory "
                           "of them")
    if path.suffix == ".jsonl":
        return {"source": source, "paths": [str(path)]}, {}, None
    loaded = load_yaml(path)
    return dict(loaded.get("data") or {}), dict(loaded.get("train") or {}), loaded.get("model")


def eval_config(source: ModelSource, data: str, overrides: list[str], mode: str) -> ExperimentConfig:
    if mode not in EVAL_MODES:
        raise CommandError(f"--mode={mode!r} is invalid: must be one of {EVAL_MODES}")
    data_section, train, model = _data_section(data, mode)
    if mode == "sft" and data_section.get("source") not in (None, "chat_jsonl"):
        raise CommandError(f"--mode=sft scores chat records: DATA's data.source={data_section['source']!r} must "
                           "be 'chat_jsonl'")
    base = copy.deepcopy(source.run_config or {})
    base.pop("rl", None)
    base["model"] = agreeing_model(model, source.config, f"SOURCE {source.path}")
    base["train"] = {**(base.get("train") or {}), **train, "mode": mode, "init_from": ""}
    base["data"] = data_section
    base["mesh"] = dict(source.mesh.shape)  # where the parameters already are
    base.pop("optim", None)
    return experiment_from_dict(apply_overrides(base, overrides))


def _progress(done: int, total: int, loss: float, sink) -> None:
    width = 24
    filled = int(width * done / total)
    sink.write(f"\r[{'#' * filled}{'.' * (width - filled)}] batch {done}/{total} loss {loss:.4f}")
    sink.flush()


def run_eval(source: ModelSource, cfg: ExperimentConfig, *, batches: int | None = None, log=sys.stderr) -> dict:
    """Score `batches` (default cfg.train.eval_batches) batches; returns the summary."""
    total_batches = cfg.train.eval_batches if batches is None else batches
    if isinstance(total_batches, bool) or not isinstance(total_batches, int) or total_batches < 1:
        raise CommandError(f"--batches={total_batches!r} is invalid: must be an integer >= 1")
    if source.tokenizer.vocab_size > cfg.model.vocab_size:
        raise CommandError(f"the tokenizer has {source.tokenizer.vocab_size} ids but the model only "
                           f"{cfg.model.vocab_size}: give the tokenizer it was trained with (--tokenizer)")
    layout = MeshLayout(cfg)
    layout.require_equal_process_rows()
    split = "validation" if cfg.data.source == "stdlib" else "train"
    iterator, stats = sharded_batches(cfg, source.tokenizer, split=split, seed_offset=1)
    batch_loss = batch_loss_fn(cfg.model, cfg.train.vocab_chunk, layout.mesh, layout.replicated)
    total = count = 0.0
    start = time.perf_counter()
    compile_s = steady_tokens = 0.0
    for index, batch in enumerate(iterator):
        if index >= total_batches:
            break
        loss_sum, tokens = np.asarray(batch_loss(source.params, layout.global_batch(batch)))
        total, count = total + float(loss_sum), count + float(tokens)
        if index == 0:
            compile_s = time.perf_counter() - start
        else:
            steady_tokens += float(tokens)
        _progress(index + 1, total_batches, total / max(count, 1.0), log)
    log.write("\n")
    seconds = time.perf_counter() - start
    if count == 0:
        raise CommandError(f"DATA has no scored token in {total_batches} batches (every loss mask is 0)")
    loss = total / count
    steady_s = seconds - compile_s
    summary = {"source": str(source.path), "step": source.step, "data": dataclasses.asdict(cfg.data),
               "split": split, "mode": cfg.train.mode, "batches": total_batches, "seq_len": cfg.train.seq_len,
               "batch_size": cfg.train.batch_size, "scored_tokens": int(count), "loss": loss,
               "tokens_per_s": round(steady_tokens / steady_s, 1) if steady_tokens else None,
               "first_batch_s": round(compile_s, 2), "seconds": round(seconds, 2), "data_stats": stats}
    if isinstance(source.tokenizer, ByteTokenizer):
        summary["bits_per_byte"] = loss / math.log(2)
    else:
        summary["perplexity"] = math.exp(min(loss, 700.0))
    return summary
