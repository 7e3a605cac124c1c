"""The run-directory lock: refused while a live process holds it, taken over once its owner died."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_jax.train.run_lock import RunLock, RunLockedError

ROOT = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; from glm5_jax.train.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); time.sleep(60)"


def _holder(run_dir):
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 30
    lock = run_dir / "run.lock"
    while not (lock.exists() and lock.stat().st_size):
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return child


def test_held_lock_is_refused_and_released_on_exit(tmp_path):
    messages = []
    with RunLock(tmp_path, log=messages.append):
        owner = json.loads((tmp_path / "run.lock").read_text())
        assert owner["pid"] == os.getpid() and owner["host"]
        with pytest.raises(RunLockedError, match=f"in use by another run \\(pid {os.getpid()} on host"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / "run.lock").exists() and messages == []
    with RunLock(tmp_path):  # free again
        pass


def test_lock_of_a_live_process_is_refused_and_of_a_killed_one_taken_over(tmp_path):
    child = _holder(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=f"pid {child.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    messages = []
    with RunLock(tmp_path, log=messages.append):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert messages and f"(pid {child.pid}" in messages[0] and "is gone" in messages[0]


def test_lock_left_by_another_host_is_refused_with_how_to_clear_it(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(RunLockedError, match="another host cannot be checked from here.*delete"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / "run.lock").read_text())["host"] == "elsewhere"
