"""The test environment's compilation cache: jax writes without a size limit (a limit makes every write scan the
whole directory), and one prune per run keeps the newest entries within the byte budget; and its collector, in
the test processes and the subprocesses they start."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from xla_env import (
    ACCESS_TIME_SUFFIX,
    CACHE_SUFFIX,
    GC_THRESHOLDS,
    REPO,
    outside_compile_cache,
    prune_compile_cache,
    subprocess_env,
)


def _entry(directory, name: str, size: int, written: int):
    path = directory / f"{name}{CACHE_SUFFIX}"
    path.write_bytes(b"x" * size)
    (directory / f"{name}{ACCESS_TIME_SUFFIX}").write_bytes(b"stamp")
    os.utime(path, (written, written))
    return path


def test_prune_keeps_the_newest_entries_that_fit_and_removes_the_older_ones_with_their_stamps(tmp_path):
    newest, middle, older, oldest = (_entry(tmp_path, name, size, written) for name, size, written in
                                     (("newest", 40, 4000), ("middle", 50, 3000), ("older", 30, 2000),
                                      ("oldest", 5, 1000)))
    other = tmp_path / "xla_flag_probe-0.10.2-xla_cpu_use_fusion_emitters"
    other.write_text("supported\n")

    removed = prune_compile_cache(tmp_path, max_bytes=100)

    # 40 + 50 fit; the older entry would pass 100 bytes, and everything written before it goes too, even what
    # would still fit, so that what stays is always the most recent part of the cache.
    assert sorted(removed) == sorted([older, oldest])
    assert newest.exists() and middle.exists() and not older.exists() and not oldest.exists()
    assert not (tmp_path / f"older{ACCESS_TIME_SUFFIX}").exists()
    assert (tmp_path / f"newest{ACCESS_TIME_SUFFIX}").exists() and other.exists()
    assert prune_compile_cache(tmp_path, max_bytes=100) == []


def test_jax_is_given_no_cache_size_limit():
    # Set in this process by tests/conftest.py before jax was imported; every subprocess inherits it.
    import jax

    assert os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] == "-1"
    assert jax.config.jax_compilation_cache_max_size == -1


def test_the_collector_skips_what_the_imports_made():
    # Set by tests/conftest.py: raised thresholds, and the objects alive after collection frozen.
    assert gc.get_threshold() == GC_THRESHOLDS and gc.get_threshold()[0] > 700
    assert gc.get_freeze_count() > 100_000


def test_subprocesses_start_with_the_same_collector_thresholds():
    code = "import gc, json; print(json.dumps(gc.get_threshold()))"
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert tuple(json.loads(out)) == GC_THRESHOLDS


def test_compiles_outside_the_cache_write_no_entry():
    """The TPU / GPU compile tiers' executables stay out of the persistent cache (tests/conftest.py); a CPU
    compile shows the mechanism: inside the block this program's entry is not written, after it it is. (The
    directory is shared with the other worker and the subprocesses: only this program's entries are counted.)"""
    import jax
    import numpy as np

    name = f"outside_cache_probe_{np.random.default_rng().integers(1 << 40)}"  # a program no other run has cached

    def compile_probe():  # a new function each time: nothing from JAX's in-memory caches
        def probe(x):
            return x * 3.0

        probe.__name__ = probe.__qualname__ = name
        jax.jit(probe).lower(1.0).compile()

    directory = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    entries = lambda: list(directory.glob(f"jit_{name}-*{CACHE_SUFFIX}"))  # noqa: E731
    with outside_compile_cache():
        compile_probe()
    assert entries() == []
    compile_probe()
    assert len(entries()) == 1
