"""Suite-wide setup: compile fast, compile each program once, and keep both xdist workers busy to the end.

XLA's CPU backend spends most of a small model's test time compiling code that runs a few times. Level 0 skips
LLVM's optimisations (about 3x faster to compile), and the older elemental fusion emitters compile about 30%
faster than the MLIR ones (a training step of the tests' 2-layer model: 34 s -> 23 s of CPU); the numerics the
tests check are unchanged. Compiled programs go to a persistent cache shared with every subprocess the tests
start (CLI runs, 8-device checks), so a program compiled once is loaded by every later test, subprocess and
run in this checkout. The settings travel through the environment, so subprocesses inherit them."""

import gc
import importlib.metadata
import inspect
import json
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # test helpers (hf_reference.py, xla_env.py) live beside this file

from xla_env import (  # noqa: E402
    GC_THRESHOLDS,
    configure_test_environment,
    outside_compile_cache,
    prune_compile_cache,
)

# Before jax is imported: jax reads JAX_* and XLA reads XLA_FLAGS when they are first used.
configure_test_environment()

import glm5_jax  # noqa: E402,F401  jax imported quietly first (glm5_jax/__init__.py), whatever a test imports


# ---------------------------------------------------------------------------------------------
# Scheduling over pytest-xdist workers (`--dist loadgroup`, set in pyproject.toml)
# ---------------------------------------------------------------------------------------------

def _shared_fixture_keys(item: pytest.Item) -> set[str]:
    """The fixtures of this suite wider than one test that `item` uses, named by where their value lives: a
    session fixture by its file and name, a module fixture by the test's module."""
    keys = set()
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        definition = definitions[-1]  # the one this test gets (the closest definition)
        source = Path(inspect.getsourcefile(definition.func) or "/").resolve()
        if definition.scope == "function" or not source.is_relative_to(TESTS):
            continue
        shared = definition.scope in ("session", "package")
        keys.add(f"{source.relative_to(TESTS.parent)}::{name}" if shared else item.nodeid.split("::")[0])
    return keys


def _work_units(items: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """Items joined into units that share a session or module fixture (transitively), in order of first
    appearance; an item that shares none is a unit of its own, keyed by its node id."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    item_keys = [sorted(_shared_fixture_keys(item)) or [item.nodeid] for item in items]
    for keys in item_keys:
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
    units: dict[str, list[pytest.Item]] = {}
    for item, keys in zip(items, item_keys):
        units.setdefault(root(keys[0]), []).append(item)
    return units


# Seconds of the suite's tests over 3 s (setup and teardown included; a grouped test's "@group" suffix dropped), from
# `CI=true PYTEST_ADDOPTS=--durations=0 bash .ci/run` on a clean clone at 8b36fc2 (2026-12-05, cold compile cache,
# idle 2-core AVX-512 VM). tests/test_suite_schedule.py checks that each names a test that exists.
# A test not listed counts SLOW_SECONDS when marked slow, else FAST_SECONDS.
MEASURED_SECONDS = json.loads((TESTS / "slowest_tests.json").read_text())
SLOW_SECONDS, FAST_SECONDS = 15, 1


def _expected_seconds(item: pytest.Item) -> float:
    if item.nodeid in MEASURED_SECONDS:
        return MEASURED_SECONDS[item.nodeid]
    return SLOW_SECONDS if item.get_closest_marker("slow") is not None else FAST_SECONDS


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that share a session or module fixture go to one xdist worker as one group, so its value (a
    trained run, a compiled step, an HF checkpoint) is built once, not once per worker; and the longest groups
    and tests run first (each worker takes the next one when it is free), so that no long test starts last and
    holds up the end of the run while the other worker is idle. The order within a group is pytest's."""
    units = _work_units(items)
    seconds = {key: sum(map(_expected_seconds, unit)) for key, unit in units.items()}
    ordered = sorted(units, key=lambda key: -seconds[key])
    items[:] = [item for key in ordered for item in units[key]]
    for key in ordered:
        if len(units[key]) > 1:
            for item in units[key]:
                item.add_marker(pytest.mark.xdist_group(key))


# pytest 9.2 names a test by its structured id, and pytest-xdist 3.8 groups tests by renaming `item._nodeid`,
# which 9.2 no longer reads: every `xdist_group` is then silently ignored, every shared fixture is built on both
# workers, and the suite takes far longer. The test extra pins pytest below 9.2.
BROKEN_GROUPING = {"pytest": (9, 2), "pytest-xdist": (3, 8, 0)}  # from this pytest, up to this pytest-xdist


def _version(package: str) -> tuple[int, ...]:
    return tuple(int(part) for part in importlib.metadata.version(package).split(".")[:3] if part.isdigit())


def pytest_configure(config: pytest.Config) -> None:
    """Bound the compilation cache's size, once per run, in the controller before any worker starts; and refuse
    there, where the message shows, the versions known to ignore the groups."""
    if not hasattr(config, "workerinput"):  # xdist workers have it
        prune_compile_cache(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))
    if (config.getoption("numprocesses", None) and config.getoption("dist", "no") == "loadgroup"
            and _version("pytest") >= BROKEN_GROUPING["pytest"]
            and _version("pytest-xdist") <= BROKEN_GROUPING["pytest-xdist"]):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {importlib.metadata.version('pytest-xdist')} ignores "
            "the xdist_group marks (shared fixtures would be built on both workers): install the versions the "
            "test extra allows (pip install -e '.[test]')")


gc.set_threshold(*GC_THRESHOLDS)  # from here: collection imports the test modules and what they import


def _freeze_imported_objects() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep the collector off what collection imported; and refuse a worker whose pytest-xdist did not take
    the groups, whatever the versions (a refused worker stops the run with an INTERNALERROR)."""
    _freeze_imported_objects()
    if not getattr(session.config.option, "loadgroup", False):  # set in xdist workers only
        return
    ungrouped = [item.nodeid for item in session.items
                 if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest-xdist ignored the xdist_group of {len(ungrouped)} tests (e.g. {ungrouped[0]}) under pytest "
            f"{pytest.__version__}: install the versions the test extra allows (pip install -e '.[test]')")


# Ahead-of-time compiles for TPUs and GPUs (the tpu_aot / gpu_aot tests) at XLA's optimization level O0: the
# same compilers (libtpu's XLA and Mosaic, the CUDA plugin's XLA and Triton) check the same programs (they
# compile, their kernels fit, their collectives and FLOPs are what the tests require) with less scheduling
# effort: 22% less CPU for a Mosaic kernel at GLM-5's shapes plus a v5p MoE layer's step (113 and 105 s -> 83
# and 87 s of user time, back to back, 2026-12-03; libtpu's LLO scheduling is most of it). `glm5 compile` and
# the benchmarks keep the default level, so the pod figures in BENCHMARKS.md are the default's. The level is
# part of the compile cache's key, and CPU compiles run at the default again after the test.
AOT_MARKERS = ("tpu_aot", "gpu_aot")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    import jax

    if not any(item.get_closest_marker(marker) for marker in AOT_MARKERS):
        yield
        return
    previous = jax.config.jax_optimization_level
    jax.config.update("jax_optimization_level", "O0")
    try:
        yield
    finally:
        jax.config.update("jax_optimization_level", previous)


@pytest.fixture(autouse=True)
def _accelerator_executables_outside_the_cache(request):
    """The TPU and GPU compile tiers' executables are not written to the persistent compilation cache
    (`xla_env.outside_compile_cache`): whatever path compiles them (kernel helpers, `glm5 compile`)."""
    if not any(request.node.get_closest_marker(tier) for tier in ("tpu_aot", "gpu_aot")):
        yield
        return
    with outside_compile_cache():
        yield


@pytest.fixture
def plain_tpu_interpret(monkeypatch):
    """The Mosaic kernels in plain interpret mode (one XLA program) instead of TPU interpret mode (a host callback
    per operation; ~1000x slower per kernel call): for tests of the whole model, whose kernels the kernel tests
    check in TPU interpret mode. The environment variable reaches subprocesses too."""
    from pallas_kernels._common import TPU_INTERPRET_CHECKS

    monkeypatch.setenv(TPU_INTERPRET_CHECKS, "0")
