"""The `rl:` section: the off-policy RL objective (`RLConfig`, losses in `glm5_jax.train.rl`) and how the
trainer runs it (`RLStepConfig`)."""

from __future__ import annotations

import dataclasses

from glm5_jax.config.core import ConfigError, from_dict

# The registered losses and advantage estimators (`glm5_jax.train.rl`, `glm5_jax.data.advantages` check
# their registries against these names).
RL_LOSS_NAMES = ("double_sided_is", "icepop_grpo", "tis")
SAMPLE_ADVANTAGE_NAMES = ("group_mean", "group_mean_std")
TOKEN_ADVANTAGE_NAMES = ("on_policy_distillation",)
ADVANTAGE_ESTIMATORS = (*SAMPLE_ADVANTAGE_NAMES, *TOKEN_ADVANTAGE_NAMES)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """RL objective. eps_low / eps_high have no default: double_sided_is and icepop_grpo refuse to run
    without them (GLM-5 gives no values for agentic RL; 0.2 / 0.28 for reasoning RL)."""

    loss: str = "double_sided_is"
    eps_low: float | None = None
    eps_high: float | None = None
    # icepop_grpo keeps tokens with pi_old / pi_rollout in [1/beta, beta].
    beta: float = 2.0
    # tis truncates pi_theta / pi_rollout at this value.
    tis_cap: float = 2.0
    advantage: str = "group_mean"
    advantage_eps: float = 1e-6
    # The log-ratio is clamped before exp so a missing or wild logprob cannot overflow.
    log_ratio_clip: float = 20.0
    # Samples generated with weights more than this many versions behind the trainer are dropped (None: keep).
    max_staleness: int | None = None

    def validate(self) -> "RLConfig":
        def fail(field, valid):
            raise ConfigError(f"RLConfig.{field}={getattr(self, field)!r} is invalid: {valid}")

        if self.loss not in RL_LOSS_NAMES:
            fail("loss", f"must be one of {sorted(RL_LOSS_NAMES)}")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            fail("advantage", f"must be one of {list(ADVANTAGE_ESTIMATORS)}")
        if self.loss in ("double_sided_is", "icepop_grpo"):
            for field in ("eps_low", "eps_high"):
                if getattr(self, field) is None:
                    fail(field, f"loss {self.loss!r} needs it set explicitly (no default), e.g. 0.2")
        if self.eps_low is not None and not 0 < self.eps_low < 1:
            fail("eps_low", "must be in (0, 1)")
        if self.eps_high is not None and not self.eps_high > 0:
            fail("eps_high", "must be > 0")
        if not self.beta > 1:
            fail("beta", "must be > 1 (the kept band is [1/beta, beta])")
        if not self.tis_cap > 0:
            fail("tis_cap", "must be > 0")
        if not self.advantage_eps > 0:
            fail("advantage_eps", "must be > 0")
        if not self.log_ratio_clip > 0:
            fail("log_ratio_clip", "must be > 0")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool)
                                               or not isinstance(self.max_staleness, int)
                                               or self.max_staleness < 0):
            fail("max_staleness", "must be None or a non-negative integer")
        return self


@dataclasses.dataclass(frozen=True)
class RLStepConfig:
    """The `rl:` section of an experiment: the loss (`RLConfig` fields, given flat) and how the trainer runs.

    replay_routing: feed the recorded expert choices and indexer top-k back to the model when the batch
      carries them (records generated with `collect_routing=True`); without them the trainer routes afresh.
    train_indexer: GLM-5 freezes the DSA indexer in RL; true lets `optim.trainable` decide.
    """

    objective: RLConfig
    replay_routing: bool = True
    train_indexer: bool = False

    def validate(self) -> "RLStepConfig":
        if not isinstance(self.objective, RLConfig):
            raise ConfigError(f"rl.objective={self.objective!r} is invalid: must be an RLConfig")
        self.objective.validate()
        for name in ("replay_routing", "train_indexer"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"rl.{name}={getattr(self, name)!r} is invalid: must be true or false")
        return self


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(RLStepConfig) if f.name != "objective")


def rl_step_config_from_dict(data: dict) -> RLStepConfig:
    """Parse an experiment's `rl:` mapping: RLConfig fields plus `replay_routing` / `train_indexer`."""
    if not isinstance(data, dict):
        raise ConfigError(f"rl={data!r} is invalid: must be a mapping of RL fields (loss, eps_low, ...)")
    step_fields = {k: v for k, v in data.items() if k in _STEP_FIELDS}
    loss_fields = {k: v for k, v in data.items() if k not in _STEP_FIELDS}
    try:
        objective = from_dict(RLConfig, loss_fields, prefix="rl.")
    except ConfigError as err:
        raise ConfigError(f"{err} (rl also accepts {list(_STEP_FIELDS)})") from None
    step = from_dict(RLStepConfig, {"objective": {}, **step_fields}, prefix="rl.")
    return dataclasses.replace(step, objective=objective).validate()


def rl_step_config_as_dict(config: RLStepConfig) -> dict:
    """The `rl:` mapping `rl_step_config_from_dict` reads back: RLConfig fields and the step fields, flat."""
    return {**dataclasses.asdict(config.objective),
            **{name: getattr(config, name) for name in _STEP_FIELDS}}


def require_rl_step_config(rl_config) -> RLStepConfig:
    """`rl_config`, validated; mode rl cannot run without one."""
    if not isinstance(rl_config, RLStepConfig):
        raise ConfigError(f"rl_config={rl_config!r} is invalid: mode 'rl' needs an RLStepConfig (an experiment's "
                          "rl: section with loss, eps_low, eps_high, ...; see rl_step_config_from_dict)")
    return rl_config.validate()
