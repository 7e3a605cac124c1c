"""An example task for `glm5 rl-async` (`task.factory: glm5_jax.examples.sort_task:SortTask`): sort a list of
digits, reward 1 for the exact sorted list followed by EOS. A task is any object with `prompts(rng, n)`,
`reward(prompt, response)`, `validate(vocab_size)`, `seq_len`, `answer_len` and `eos`
(glm5_jax.rollout.async_rl); the config's other `task:` fields are the factory's keyword arguments."""

from __future__ import annotations

import dataclasses

import numpy as np

from glm5_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class SortTask:
    """Prompt [BOS, d_1 .. d_n, SEP]; answer sorted(d) + [EOS]. Digits are token ids 0-9."""

    num_digits: int = 5
    bos: int = 10
    sep: int = 11
    eos: int = 12

    def validate(self, vocab_size: int) -> "SortTask":
        if not isinstance(self.num_digits, int) or self.num_digits < 1:
            raise ConfigError(f"task.num_digits={self.num_digits!r} is invalid: must be a positive integer")
        for name in ("bos", "sep", "eos"):
            value = getattr(self, name)
            if not 10 <= value < vocab_size:
                raise ConfigError(f"task.{name}={value!r} is invalid: must be a non-digit id in [10, {vocab_size})")
        return self

    @property
    def prompt_len(self) -> int:
        return self.num_digits + 2

    @property
    def answer_len(self) -> int:
        return self.num_digits + 1

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len

    def prompts(self, rng: np.random.Generator, n: int) -> np.ndarray:
        digits = rng.integers(0, 10, (n, self.num_digits))
        return np.concatenate([np.full((n, 1), self.bos), digits, np.full((n, 1), self.sep)], 1).astype(np.int32)

    def answer(self, prompt: np.ndarray) -> np.ndarray:
        return np.append(np.sort(prompt[1:-1]), self.eos).astype(np.int32)

    def reward(self, prompt: np.ndarray, response: np.ndarray) -> float:
        return float(np.array_equal(np.asarray(response), self.answer(prompt)))

    def sft_batch(self, rng: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
        """Prompt + answer sequences with the loss on the answer tokens (the mode "sft" batch)."""
        prompts = self.prompts(rng, batch_size)
        tokens = np.stack([np.concatenate([p, self.answer(p)]) for p in prompts]).astype(np.int32)
        loss_mask = np.zeros_like(tokens)
        loss_mask[:, self.prompt_len:] = 1
        return {"tokens": tokens, "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), tokens.shape),
                "segment_ids": np.ones_like(tokens), "loss_mask": loss_mask}
