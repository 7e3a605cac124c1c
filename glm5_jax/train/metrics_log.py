"""Where a run's step metrics go: metrics.jsonl (every step, skipped ones marked), TensorBoard (logged steps)
and a progress line every `train.log_every` steps with throughput, model TFLOP/s and MFU. Only the primary
process writes; the others keep the first and last losses for the summary."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from glm5_jax.config import TrainConfig
from glm5_jax.train.tensorboard import SummaryWriter

_PROGRESS_WIDTH = 24


def metrics_to_host(metrics: dict) -> dict:
    """Floats (scalars) and rounded lists (per-layer arrays) of the step's metrics."""
    out = {}
    for key, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        out[key] = float(value) if value.ndim == 0 else [round(float(v), 6) for v in value.ravel()]
    return out


def progress_line(step: int, total: int, metrics: dict, tokens_per_s: float, elapsed: float) -> str:
    done = int(_PROGRESS_WIDTH * step / total)
    eta = elapsed / max(step, 1) * (total - step)
    return (f"[{'#' * done}{'.' * (_PROGRESS_WIDTH - done)}] step {step}/{total} loss {metrics['loss']:.4f} "
            f"tok/s {tokens_per_s:,.0f} eta {eta:,.0f}s")


class MetricsLog:
    def __init__(self, run_dir: Path, train: TrainConfig, *, first_step: int, flops_per_token: float,
                 primary: bool, log):
        self.train, self.flops_per_token, self.log = train, flops_per_token, log
        self.writer = SummaryWriter(run_dir / "tb", first_step=first_step) if primary else None
        self.file = open(run_dir / "metrics.jsonl", "a") if primary else None
        self.first_loss = self.last = None
        self.start = self.window_start = time.perf_counter()
        self.window_tokens = 0.0

    def skipped(self, step: int, host: dict) -> None:
        self._write({"step": step, "skipped": True, **host})

    def record(self, step: int, host: dict) -> None:
        """A step that was applied: throughput over the window since the last progress line, then its row."""
        self.window_tokens += host["tokens"]
        self.first_loss = host["loss"] if self.first_loss is None else self.first_loss
        if step % self.train.log_every == 0 or step == self.train.steps:
            now = time.perf_counter()
            tokens_per_s = self.window_tokens / (now - self.window_start)
            host["tokens_per_s"] = tokens_per_s
            host["model_tflops_per_s"] = tokens_per_s * self.flops_per_token / 1e12
            if self.train.peak_flops_per_device:
                host["mfu"] = tokens_per_s * self.flops_per_token / (self.train.peak_flops_per_device
                                                                     * jax.device_count())
            self.log(progress_line(step, self.train.steps, host, tokens_per_s, now - self.start))
            self.window_start, self.window_tokens = now, 0.0
            if self.writer is not None:
                self.writer.scalars(step, {k: v for k, v in host.items() if isinstance(v, float)})
        self._write({"step": step, **host})
        self.last = host

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def _write(self, row: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
