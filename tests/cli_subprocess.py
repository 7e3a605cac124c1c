"""`glm5 ...` as a subprocess of the checkout under test (one device, CPU), for tests of the command line."""

import subprocess
import sys

from xla_env import REPO, subprocess_env


def run_glm5(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm5_jax.cli", *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=REPO, timeout=timeout)
