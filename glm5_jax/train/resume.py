"""What a resumed run must agree on with the run it continues.

The experiment config saved with the checkpoint is compared with the new one: a changed batch size, model
or optimizer silently trains a different experiment, so any difference outside `RESUME_MAY_CHANGE` is refused
naming the fields (unless the user allows it). Metrics logged after the restored step (steps that ran, or were
being saved, when the run died) are dropped so that each step is in metrics.jsonl once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from glm5_jax.config import ConfigError
from glm5_jax.config.experiment import SECTIONS
from glm5_jax.config.rl import RLConfig, RLStepConfig, rl_step_config_as_dict

# How long to train, how often to log / evaluate / save, and where: changing these continues the same run.
RESUME_MAY_CHANGE = ("train.steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.run_dir",
                     "train.peak_flops_per_device", "train.non_finite", "checkpoint.every", "checkpoint.keep",
                     "checkpoint.resume")
RESUME_MAY_CHANGE_SECTIONS = ("mesh.",)  # the same state, laid out on other devices


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def _plain(data) -> dict:
    return json.loads(json.dumps(data))


def config_changes(saved: dict, current: dict, defaults: dict | None = None) -> list[tuple[str, object, object]]:
    """(field, saved value, current value) for every differing leaf field. A field absent from the saved
    config (a checkpoint older than the field) counts as unchanged when the current value is its default."""
    old, new = _flatten(_plain(saved)), _flatten(_plain(current))
    defaults = _flatten(_plain(defaults or {}))
    changes = []
    for key in sorted(set(old) | set(new)):
        if key not in old and key in defaults and new.get(key) == defaults[key]:
            continue
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            changes.append((key, old.get(key, "<absent>"), new.get(key, "<absent>")))
    return changes


def default_experiment_dict() -> dict:
    """Every section's default values (to compare checkpoints saved before a field existed, or whose rl:
    section held only the fields the file gave)."""
    return {**{name: dataclasses.asdict(cls()) for name, cls in SECTIONS.items()},
            "rl": rl_step_config_as_dict(RLStepConfig(objective=RLConfig()))}


def _may_change(field: str) -> bool:
    return field in RESUME_MAY_CHANGE or field.startswith(RESUME_MAY_CHANGE_SECTIONS)


def check_resume_config(saved: dict | None, current: dict, *, step: int, allow_change: bool,
                        defaults: dict | None = None) -> list[str]:
    """Refuse a resume whose config differs from the checkpoint's outside RESUME_MAY_CHANGE, unless
    `allow_change`. Returns the differences that matter for training ("field: old -> new") either way."""
    if saved is None:
        return []
    changes = [f"{field}: {old!r} -> {new!r}" for field, old, new in config_changes(saved, current, defaults)
               if not _may_change(field)]
    if changes and not allow_change:
        raise ConfigError(
            f"refusing to resume from step {step}: the experiment config differs from the one the checkpoint "
            f"was trained with in {len(changes)} field(s): " + "; ".join(changes)
            + ". Restore those values, use another train.run_dir, or pass --allow-config-change to continue "
            "with the new values")
    return changes


def drop_metrics_after(path: str | Path, step: int) -> int:
    """Keep only metrics.jsonl lines for steps <= `step` (the restored one); returns how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line).get("step")
        except ValueError:  # a line cut short by the kill
            dropped += 1
            continue
        if isinstance(record_step, int) and record_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, path)
    return dropped
