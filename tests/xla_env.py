"""The JAX/XLA environment of the test process and of every subprocess a test starts: CPU only, fast compiles,
one persistent compilation cache. Everything is set through environment variables, before jax is imported,
so subprocesses inherit it (they add only what differs, e.g. a fake device count)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Ignored by git; kept between runs so a second run of the suite in this checkout loads what the first compiled.
# A clean clone (CI) starts empty and still shares compiles between the tests of one run.
DEFAULT_CACHE_DIR = REPO / ".cache" / "jax_tests"
CACHE_MAX_BYTES = 2 * 2**30  # least recently used entries are evicted above this

# Always understood by XLA:CPU: skip LLVM's optimisation passes.
BASE_FLAGS = ("--xla_backend_optimization_level=0",)
# Faster to compile where this XLA has them; XLA aborts the process on a flag it does not know, so each is
# probed once per jaxlib version (the answer is kept in the cache directory).
OPTIONAL_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def _supported(flag: str, cache_dir: Path) -> bool:
    version = importlib.metadata.version("jaxlib")
    record = cache_dir / f"xla_flag_probe-{version}-{_flag_name(flag).lstrip('-')}"
    if record.exists():
        return record.read_text().strip() == "supported"
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                           timeout=300)
    answer = "supported" if probe.returncode == 0 else "unknown"
    record.write_text(answer + "\n")
    return answer == "supported"


def configure_test_environment() -> None:
    """CPU platform, fast-compile XLA flags and the persistent compilation cache, in os.environ (values the
    caller already set win)."""
    # libtpu (the test extra, for AOT compiles) would otherwise probe for a TPU in every process.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cache_dir = Path(os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(DEFAULT_CACHE_DIR)))
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Every compile is cached: the small ones add up over a few hundred tests.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(CACHE_MAX_BYTES))
    flags = os.environ.get("XLA_FLAGS", "").split()
    present = {_flag_name(f) for f in flags}
    for flag in BASE_FLAGS + OPTIONAL_FLAGS:
        if _flag_name(flag) not in present and (flag in BASE_FLAGS or _supported(flag, cache_dir)):
            flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess running the checkout under test, with `devices` fake CPU
    devices when given."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **extra}
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if _flag_name(f) != "--xla_force_host_platform_device_count"]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env
