"""`glm5 rollout SOURCE PROMPTS.jsonl --out FILE`: sampled rollouts with rewards, as the records `glm5 train`
reads in RL mode (`data.source=rollouts`).

Each prompt is sampled `--samples` times (one group: group id = the prompt's id); every record keeps the
token ids, the exact logprobs of the sampled tokens (`generation.sampling`), the routing when `--routing`
is given (expert choices and indexer top-k, for routing replay), the checkpoint step as its weight version
and the reward `--reward module:function` gives, called as `function(text, record)` on each sample's decoded
text and the prompt's JSON object; it must return a finite number. The trainer computes the group
advantages from those rewards over whole groups (`rl.advantage`); the summary reports them as GRPO's
(reward - group mean) / group std would.

Nothing is half-written. Prompts are generated `--batch-prompts` at a time; a batch's records (whole groups)
are added to FILE only after every reward of the batch was computed, by writing the old records plus the
new ones beside FILE, fsyncing that file and renaming it over FILE (atomic on POSIX), so a run killed at any
point leaves FILE as it was after some batch (rewriting the whole file per batch is quadratic in the number
of batches, negligible next to generation at the sizes one machine rolls out). `--append` continues:
prompts whose group id is already in FILE are skipped, so nothing is generated twice; batch k of a prompts
file samples with the key of its first prompt's place in the file, so a continued run draws what an
uninterrupted one would (same --batch-prompts). Without `--append` an existing FILE is refused.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from glm5_jax.commands.generate import GenerateOptions, batches, run_batch
from glm5_jax.commands.importable import load_callable
from glm5_jax.commands.prompts import Prompt, check_context
from glm5_jax.commands.source import CommandError, ModelSource, decode_text
from glm5_jax.config.rl import RLConfig
from glm5_jax.data.advantages import group_mean_std_advantages
from glm5_jax.data.rollouts import RolloutRecord, read_rollouts, validate_records, write_rollouts
from glm5_jax.generation import to_rollout_records


def load_reward(spec: str) -> Callable:
    """The function named by `module:function` (imported now, before any model is read)."""
    return load_callable(spec, field="--reward", example="glm5_jax.examples.rewards:python_line")


def score(reward: Callable, text: str, prompt: Prompt, sample: int) -> float:
    """reward(text, record) as a finite float; a failure names the prompt and sample."""
    where = f"prompt {prompt.prompt_id!r} ({prompt.where}), sample {sample}"
    try:
        value = reward(text, prompt.record)
    except Exception as err:  # the user's function: any failure is reported against its record
        raise CommandError(f"the reward function raised {type(err).__name__}: {err} for {where}") from None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise CommandError(f"the reward function returned {value!r} for {where}; it must return a number") from None
    if not math.isfinite(value):
        raise CommandError(f"the reward function returned {value} for {where}; it must be finite")
    return value


def check_out(path: Path, append: bool) -> list[RolloutRecord]:
    """The records already in `path` (when appending); refuses an existing file without --append."""
    if path.exists() and not append:
        raise CommandError(f"--out {str(path)!r} exists: pass --append to add to it (prompts already in it are "
                           "skipped) or choose another file")
    if not path.parent.is_dir():
        raise CommandError(f"--out {str(path)!r}: directory {str(path.parent)!r} does not exist")
    return read_rollouts(path) if path.exists() else []


def write_atomically(path: Path, records: list[RolloutRecord]) -> None:
    """FILE := records, atomically and durably: written beside it, fsynced, renamed over it."""
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")  # same suffix: same format
    write_rollouts(partial, records)
    with open(partial, "rb") as written:
        os.fsync(written.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def run_rollout(source: ModelSource, prompts: list[Prompt], options: GenerateOptions, *, reward: Callable,
                samples: int, out: Path, existing: list[RolloutRecord], batch_prompts: int, log=sys.stderr) -> dict:
    """Roll out every prompt not yet in `existing` (the records of `out`, from `check_out`)."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise CommandError(f"--samples={samples!r} is invalid: must be an integer >= 1")
    if batch_prompts < 1:
        raise CommandError(f"--batch-prompts={batch_prompts} is invalid: must be >= 1")
    options = options.validate(source)
    check_context(prompts, max_new_tokens=options.sampling.max_new_tokens, lookahead=options.speculative,
                  context=source.config.max_position_embeddings)
    done_groups = {record.group_id for record in existing}
    todo = [p for p in prompts if p.prompt_id not in done_groups]
    log.write(f"{len(prompts) - len(todo)} of {len(prompts)} prompts already in {out}; rolling out {len(todo)} "
              f"x {samples} samples\n")
    position = {p.prompt_id: index for index, p in enumerate(prompts)}
    records_so_far, rewards, advantages = list(existing), [], []
    for index, chunk in batches(todo, batch_prompts):
        rows = [p for p in chunk for _ in range(samples)]
        # Keyed by the first prompt's place in the file: a continued run samples as an uninterrupted one would.
        output = run_batch(source, rows, options, position[chunk[0].prompt_id])
        texts = [decode_text(source, output.tokens[row, :output.lengths[row]]) for row in range(len(rows))]
        chunk_rewards = [score(reward, text, prompt, row % samples)
                         for row, (text, prompt) in enumerate(zip(texts, rows))]
        records = to_rollout_records(output, rollout_ids=[f"{p.prompt_id}/{row % samples}"
                                                          for row, p in enumerate(rows)],
                                     group_ids=[p.prompt_id for p in rows], rewards=chunk_rewards,
                                     weight_versions=source.step)
        validate_records(records, vocab_size=source.config.vocab_size)
        records_so_far += records
        write_atomically(out, records_so_far)
        rewards += chunk_rewards
        advantages += group_mean_std_advantages(chunk_rewards, [p.prompt_id for p in rows], RLConfig()).tolist()
        log.write(f"batch {index + 1}: {len(records)} records, mean reward {np.mean(chunk_rewards):.3f}; "
                  f"{len(records_so_far)} in {out}\n")
    return {"out": str(out), "records": len(records_so_far), "new_records": len(rewards), "prompts": len(prompts),
            "skipped_prompts": len(prompts) - len(todo), "samples": samples, "weight_version": source.step,
            "reward_mean": float(np.mean(rewards)) if rewards else None,
            "groups_with_signal": int(sum(np.std(rewards[i:i + samples]) > 0
                                          for i in range(0, len(rewards), samples))),
            "advantage_abs_mean": float(np.mean(np.abs(advantages))) if advantages else None}
