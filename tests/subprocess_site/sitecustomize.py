"""Run by Python at the start of every subprocess the tests start (`glm5` commands, the 8-device and 2-process
check scripts): `xla_env.subprocess_env` puts this directory on PYTHONPATH and passes the test processes'
garbage-collector thresholds (`xla_env.GC_THRESHOLDS`) in GLM5_TEST_GC_THRESHOLDS. JAX's tracing makes objects
far faster than Python's default thresholds expect; with these, an 8-device check script took ~5% less CPU
(34.7 -> 32.0 and 33.2 -> 31.8 s of user time, 2026-12-05)."""

import gc
import os

if os.environ.get("GLM5_TEST_GC_THRESHOLDS"):
    gc.set_threshold(*(int(part) for part in os.environ["GLM5_TEST_GC_THRESHOLDS"].split(",")))
