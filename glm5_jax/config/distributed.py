"""The `distributed:` section: how a process joins a multi-process JAX job (`glm5_jax.distributed.runtime`)."""

from __future__ import annotations

import dataclasses

INITIALIZE_MODES = ("auto", "on", "off")



@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    initialize: str = "auto"
    heartbeat_timeout_s: int = 60
    # How long the first contact with the coordinator may take before the process gives up.
    init_timeout_s: int = 300

    def validate(self) -> "DistributedConfig":
        if self.initialize not in INITIALIZE_MODES:
            raise ValueError(f"distributed.initialize={self.initialize!r} is invalid: must be one of "
                             f"{INITIALIZE_MODES}")
        for name in ("heartbeat_timeout_s", "init_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"distributed.{name}={value!r} is invalid: must be an integer >= 1 (seconds)")
        return self
