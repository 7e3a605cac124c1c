"""Suite-wide setup. XLA's CPU backend spends most of a small model's test time optimising code that runs a
few times; level 0 compiles about 3x faster and leaves the numerics the tests check unchanged."""

import os
import sys
from pathlib import Path

# libtpu (the test extra, for AOT compiles) would otherwise probe for a TPU in every process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# Test helpers (hf_reference.py) live beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tempfile  # noqa: E402

import jax  # noqa: E402

# Identical programs compiled by several tests (same config, same step) are compiled once per session.
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="glm5_jax_xla_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
