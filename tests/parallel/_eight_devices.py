"""Imported first by the 8-device check scripts run as subprocesses (`_multidevice_checks.py`,
`_context_checks.py`): the fake device count must be in the environment before jax is imported."""

import os

os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    # Cheaper LLVM code generation: compile time dominates these small checks (buffer sizes are unchanged).
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"])
os.environ["JAX_PLATFORMS"] = "cpu"
