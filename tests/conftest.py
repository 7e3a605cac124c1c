"""Suite-wide setup: compile fast, and compile each program once.

XLA's CPU backend spends most of a small model's test time compiling code that runs a few times. Level 0 skips
LLVM's optimisations (about 3x faster to compile), and the older elemental fusion emitters compile about 30%
faster than the MLIR ones (a training step of the tests' 2-layer model: 34 s -> 23 s of CPU); the numerics the
tests check are unchanged. Compiled programs go to a persistent cache shared with every subprocess the tests
start (CLI runs, 8-device checks), so a program compiled once is loaded by every later test, subprocess and
run in this checkout. The settings travel through the environment, so subprocesses inherit them."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # test helpers (hf_reference.py, xla_env.py) live beside this file

from xla_env import configure_test_environment  # noqa: E402

# Before jax is imported: jax reads JAX_* and XLA reads XLA_FLAGS when they are first used.
configure_test_environment()

import glm5_jax  # noqa: E402,F401  jax imported quietly first (glm5_jax/__init__.py), whatever a test imports
