"""The JAX/XLA environment of the test process and of every subprocess a test starts: CPU only, fast compiles,
one persistent compilation cache. Everything is set through environment variables, before jax is imported,
so subprocesses inherit it (they add only what differs, e.g. a fake device count). `run_pass_checks` runs a
check script in such a subprocess and requires its PASS lines."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Ignored by git; kept between runs so a second run of the suite in this checkout loads what the first compiled.
# A clean clone (CI) starts empty and still shares compiles between the tests of one run.
DEFAULT_CACHE_DIR = REPO / ".cache" / "jax_tests"
CACHE_MAX_BYTES = 2 * 2**30  # the oldest entries are removed above this, once per test run (prune_compile_cache)
CACHE_SUFFIX, ACCESS_TIME_SUFFIX = "-cache", "-atime"  # jax's names for an entry and its last-use stamp

# Always understood by XLA:CPU: skip LLVM's optimisation passes.
BASE_FLAGS = ("--xla_backend_optimization_level=0",)
# Faster to compile where this XLA has them; XLA aborts the process on a flag it does not know, so each is
# probed once per jaxlib version (the answer is kept in the cache directory). The older elemental fusion
# emitters; and one LLVM module per program: XLA:CPU otherwise splits each program's module into parts to
# compile them in parallel, and the split itself (llvm::SplitModule) took ~9% of the CPU samples of the tiny
# step's compile (perf), on cores that the two xdist workers keep busy anyway.
# XLA's matmuls as library calls in the GPU compile tier (the CUDA plugin's AOT compiles; XLA:CPU ignores it)
# instead of generated Triton GEMM fusions (the Pallas kernels are Triton still): the GPU tier took 176 instead of
# 196 s of CPU (2026-12-04). Not ptxas at -O0 (`--xla_gpu_disable_gpuasm_optimizations`): it saves 10% of a whole
# h200-16 step's compile but takes longer on the big Triton kernels (the GLM-5-shaped sparse MLA backward's PTX:
# 6.8 s at -O0, 3.8 s at -O3), so the tier took 16 s more CPU with it (152 vs 138 and 166 vs 149 s, 2026-12-05).
OPTIONAL_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1",
                  "--xla_gpu_enable_triton_gemm=false")

# Python's cyclic collector walks the whole heap (jax, torch and transformers are imported by then) in every
# full collection, and tracing makes objects far faster than the default thresholds (700, 10, 10) expect: the
# collector took 8.9% of the CPU samples of a warm-cache run of tests/model/test_model.py + tests/train/
# test_step.py (perf, 2026-12-02), 3.6% with higher thresholds and what collection imported frozen out of the
# collections (it lives for the whole run). Set by tests/conftest.py, in the xdist workers and a -n 0 run
# alike, and by tests/subprocess_site/sitecustomize.py in the subprocesses they start (`subprocess_env`).
GC_THRESHOLDS = (10_000, 20, 20)
SUBPROCESS_SITE = REPO / "tests" / "subprocess_site"


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
    # No size limit inside jax: with one, every write locks the directory and reads every entry's size and
    # last-use stamp to pick what to evict (0.2 s per write at 3,600 entries, a few thousand writes per run:
    # tests/model/test_model.py took 2.5x the CPU time). prune_compile_cache bounds the size once per run.
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
    flags = os.environ.get("XLA_FLAGS", "").split()
    present = {_flag_name(f) for f in flags}
    for flag in BASE_FLAGS + OPTIONAL_FLAGS:
        if _flag_name(flag) not in present and (flag in BASE_FLAGS or _supported(flag, cache_dir)):
            flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)


def cpu_code_flags() -> str:
    """XLA_FLAGS less the flags only a GPU compile reads: the flags XLA:CPU's bits can depend on."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_gpu_"))


def prune_compile_cache(cache_dir: Path, max_bytes: int = CACHE_MAX_BYTES) -> list[Path]:
    """Remove the oldest-written entries of the compilation cache until it holds at most `max_bytes`; returns the
    removed entries. Run once per test run, before any test process writes to the cache."""
    stats = sorted(((path.stat(), path) for path in cache_dir.glob(f"*{CACHE_SUFFIX}")),
                   key=lambda entry: entry[0].st_mtime, reverse=True)
    kept_bytes, full, removed = 0, False, []
    for stat, path in stats:  # newest first
        full = full or kept_bytes + stat.st_size > max_bytes
        if not full:
            kept_bytes += stat.st_size
        else:
            path.unlink(missing_ok=True)
            path.with_name(path.name.removesuffix(CACHE_SUFFIX) + ACCESS_TIME_SUFFIX).unlink(missing_ok=True)
            removed.append(path)
    return removed


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess running the checkout under test, with `devices` fake CPU
    devices when given."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(SUBPROCESS_SITE)]), "JAX_PLATFORMS": "cpu",
           "GLM5_TEST_GC_THRESHOLDS": ",".join(map(str, GC_THRESHOLDS)), **extra}
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if _flag_name(f) != "--xla_force_host_platform_device_count"]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


@contextlib.contextmanager
def outside_compile_cache():
    """Compiles in this block stay out of the persistent compilation cache: an executable compiled ahead of time
    for a TPU or GPU this machine lacks cannot be read back from it (a later run would warn and compile again),
    and serialising and compressing it costs CPU for nothing."""
    import jax

    option = "jax_persistent_cache_min_compile_time_secs"
    previous = getattr(jax.config, option)
    jax.config.update(option, float("inf"))
    try:
        yield
    finally:
        jax.config.update(option, previous)


def run_pass_checks(script: Path, *args: str, expected: Sequence[str], timeout: int = 600) -> str:
    """Run a check script in a subprocess of this checkout (`subprocess_env()`, from the repository root) and
    require that it exits 0 and prints a "PASS <name>..." line for every name in `expected`. Returns its stdout."""
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                            env=subprocess_env(), cwd=REPO, timeout=timeout)
    label = " ".join([script.name, *args])
    assert result.returncode == 0, f"{label} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    passed = [line[len("PASS "):] for line in result.stdout.splitlines() if line.startswith("PASS ")]
    for name in expected:
        assert any(line.startswith(name) for line in passed), f"{label}: no PASS for {name!r}:\n{result.stdout}"
    return result.stdout
