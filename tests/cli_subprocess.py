"""`glm5 ...` as a subprocess of the checkout under test (one device, CPU), for tests of the command line."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_glm5(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(REPO),
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "glm5_jax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout)
