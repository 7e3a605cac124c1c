"""The `optim:` section: optimizer, learning-rate schedule and trainable parameters (`glm5_jax.train.optim`)."""

from __future__ import annotations

import dataclasses
import re

from glm5_jax.config.core import _fail

OPTIMIZERS = ("adamw", "muon")
TRAINABLE_PRESETS = ("all", "indexer", "non_indexer")
SCHEDULES = ("cosine", "linear", "constant")
MOMENT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer, schedule and trainable-parameter settings. Defaults follow GLM-5 pre-training."""

    name: str = "muon"
    lr: float = 2e-4
    min_lr: float = 4e-5  # the schedule's end value (ignored by "constant")
    warmup_steps: int = 100
    total_steps: int = 10_000
    schedule: str = "cosine"
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0  # 0 disables clipping
    muon_momentum: float = 0.95
    ns_steps: int = 5
    muon_rms: float = 0.2
    muon_split: bool = True
    # On a mesh, Newton-Schulz on whole matrices with the stacked layers spread over the devices (no Gram-matrix
    # all-reduce; more memory, e.g. +2.5 GiB per chip for GLM-5 on v5p-512); false keeps it on FSDP shards.
    muon_spread_layers: bool = True
    # The first moment's dtype (Muon's momentum, AdamW's mu; AdamW's second moment keeps the parameter's): null
    # keeps the parameter's dtype. bfloat16 halves the largest optimizer state, as DeepSeek-V3 keeps AdamW's moments
    # (GLM-5 on v5p-512: -5.4 GiB per chip, what lets its recipe keep the routed experts' projections).
    mu_dtype: str | None = None
    # "all" | "indexer" | "non_indexer" | path regexes (re.search on "a/b/c" leaf paths).
    # Annotated tuple-first so YAML lists and single strings both load through glm5_jax.config.
    trainable: tuple[str, ...] | str = "all"

    def __post_init__(self):
        trainable = self.trainable
        if isinstance(trainable, list):
            trainable = tuple(trainable)
        if isinstance(trainable, tuple) and len(trainable) == 1 and trainable[0] in TRAINABLE_PRESETS:
            trainable = trainable[0]
        object.__setattr__(self, "trainable", trainable)
        self.validate()

    def validate(self) -> "OptimConfig":
        if self.name not in OPTIMIZERS:
            _fail("optim.name", self.name, f"must be one of {OPTIMIZERS}")
        if self.schedule not in SCHEDULES:
            _fail("optim.schedule", self.schedule, f"must be one of {SCHEDULES}")
        if not self.lr > 0:
            _fail("optim.lr", self.lr, "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            _fail("optim.min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        for field in ("warmup_steps", "total_steps", "ns_steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(f"optim.{field}", value, "must be a non-negative integer")
        if self.total_steps < 1:
            _fail("optim.total_steps", self.total_steps, "must be >= 1")
        if self.ns_steps < 1:
            _fail("optim.ns_steps", self.ns_steps, "must be >= 1")
        if self.warmup_steps > self.total_steps:
            _fail("optim.warmup_steps", self.warmup_steps, f"must be <= total_steps ({self.total_steps})")
        for field in ("b1", "b2", "muon_momentum"):
            value = getattr(self, field)
            if not 0 <= value < 1:
                _fail(f"optim.{field}", value, "must be in [0, 1)")
        if not self.eps > 0:
            _fail("optim.eps", self.eps, "must be > 0")
        if not self.muon_rms > 0:
            _fail("optim.muon_rms", self.muon_rms, "must be > 0 (Moonlight / GLM use 0.2)")
        for field in ("weight_decay", "grad_clip_norm"):
            if not getattr(self, field) >= 0:
                _fail(f"optim.{field}", getattr(self, field), "must be >= 0")
        for field in ("muon_split", "muon_spread_layers"):
            if not isinstance(getattr(self, field), bool):
                _fail(f"optim.{field}", getattr(self, field), "must be true or false")
        if self.mu_dtype is not None and self.mu_dtype not in MOMENT_DTYPES:
            _fail("optim.mu_dtype", self.mu_dtype, f"must be null (the parameter's dtype) or one of {MOMENT_DTYPES}")
        if isinstance(self.trainable, str):
            if self.trainable not in TRAINABLE_PRESETS:
                _fail("optim.trainable", self.trainable,
                      f"must be one of {TRAINABLE_PRESETS} or a list of path regexes")
        elif isinstance(self.trainable, tuple) and self.trainable:
            for pattern in self.trainable:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as err:
                    _fail("optim.trainable", pattern, f"is not a valid regular expression ({err})")
        else:
            _fail("optim.trainable", self.trainable,
                  f"must be one of {TRAINABLE_PRESETS} or a non-empty list of path regexes")
        return self
