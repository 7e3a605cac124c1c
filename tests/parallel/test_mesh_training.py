"""`glm5 train` on a device mesh and on several processes (jax.distributed over 127.0.0.1, gloo collectives):
the same losses as one device, checkpoints that move between process counts bit-exactly, and a clean failure
when a process dies. Every run is a `glm5 train` subprocess with its own fake CPU device count."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from xla_env import subprocess_env

REPO = Path(__file__).resolve().parents[2]
# Small enough to compile in seconds; every feature of tiny.yaml (MoE, DSA top-k, MTP) stays on.
BASE = ["configs/tiny.yaml", "train.seq_len=64", "train.batch_size=8", "train.log_every=1", "data.max_files=4",
        "data.validation_fraction=0", "checkpoint.every=2", "model.index_topk=8"]
MESH = ["mesh.fsdp=4", "mesh.expert=2"]
TIMEOUT = 420

pytestmark = pytest.mark.slow


_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                    "JAX_COMPILATION_CACHE_MAX_SIZE")


def _env(devices: int, **extra) -> dict:
    env = subprocess_env(devices=devices, **extra)
    if "JAX_NUM_PROCESSES" in extra:
        # No shared persistent compile cache across a jax.distributed job: in CI two processes of one job that
        # shared it hung in their first step (one read an executable the other compiled).
        for name in _CACHE_VARIABLES:
            env.pop(name, None)
    return env


def _train_command(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "glm5_jax.cli", "train", *BASE, f"train.steps={steps}",
            f"train.run_dir={run_dir}", *overrides]


def train_single(run_dir: Path, steps: int, devices: int, *overrides: str) -> None:
    result = subprocess.run(_train_command(run_dir, steps, *overrides), cwd=REPO, env=_env(devices),
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-4000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_processes(run_dir: Path, steps: int, *overrides: str, count: int = 2, devices: int = 4):
    port = _free_port()
    procs = []
    for index in range(count):
        env = _env(devices, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count),
                   JAX_PROCESS_ID=str(index))
        procs.append(subprocess.Popen(_train_command(run_dir, steps, *overrides), cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return procs


def _kill_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train_multiprocess(run_dir: Path, steps: int, *overrides: str) -> None:
    procs = start_processes(run_dir, steps, *overrides)
    try:
        outputs = [proc.communicate(timeout=TIMEOUT) for proc in procs]
    finally:
        _kill_all(procs)
    for index, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {index}:\n{err[-4000:]}"


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def saved(run_dir: Path, step: int) -> tuple[list[np.ndarray], dict]:
    """Parameter arrays (host copies, in tree order) and data position of checkpoint `step`, read back onto
    this process's one device whatever mesh wrote them."""
    import jax
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    handlers = {"params": ocp.StandardCheckpointHandler(), "data_state": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(run_dir / "checkpoints", item_handlers=handlers) as manager:
        metadata = manager.item_metadata(step)["params"]
        metadata = getattr(metadata, "tree", metadata)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target),
                                                                 data_state=ocp.args.JsonRestore()))
    return [np.asarray(x) for x in jax.tree.leaves(restored["params"])], restored["data_state"]["value"]


SHARDS = "data.shards=2"  # two data streams, as the two-process runs read them


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory) -> Path:
    """The same 3 steps on one device ("one") and on an 8-device mesh in one process ("mesh"), shared by the
    mesh and the two-process tests (the mesh run is the one-process reference of the two-process run)."""
    root = tmp_path_factory.mktemp("mesh_runs")
    train_single(root / "one", 3, 1, SHARDS)
    train_single(root / "mesh", 3, 8, *MESH, SHARDS)
    return root


def test_mesh_run_equals_single_device(mesh_runs):
    np.testing.assert_allclose(losses(mesh_runs / "mesh"), losses(mesh_runs / "one"), rtol=1e-5, atol=1e-5)
    log = (mesh_runs / "mesh" / "metrics.jsonl").read_text()
    assert len(log.splitlines()) == 3


def resumable_copy(source: Path, target: Path, step: int) -> None:
    """A copy of a finished run's directory that holds checkpoints up to `step` only: resuming it continues from
    `step` exactly as the interrupted run would (the runner drops metrics logged after the restored step)."""
    shutil.copytree(source, target)
    for saved_step in (target / "checkpoints").iterdir():
        if saved_step.name.isdigit() and int(saved_step.name) > step:
            shutil.rmtree(saved_step)


HEARTBEAT = "distributed.heartbeat_timeout_s=10"


@pytest.fixture(scope="module")
def killed_two_process_run(tmp_path_factory):
    """Two processes that train the mesh runs' experiment from scratch until their step-2 checkpoint is saved,
    when one of them is killed: (run directory, the survivor's exit code, its stderr, seconds it took to
    exit). One job serves three checks (its first steps against one process, its checkpoint resumed by one
    process, the survivor's failure): each job of two processes compiles its own training step, since they
    cannot share the compile cache."""
    run_dir = tmp_path_factory.mktemp("killed") / "two"
    procs = start_processes(run_dir, 400, *MESH, SHARDS, HEARTBEAT)
    try:
        metrics, checkpoint = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "2"
        deadline = time.monotonic() + TIMEOUT
        while not (checkpoint.is_dir() and metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "the processes never saved step 2"
            assert all(proc.poll() is None for proc in procs), procs[0].stderr.read()[-4000:]
            time.sleep(1)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        waited = time.monotonic() - killed_at
    finally:
        _kill_all(procs)
    return run_dir, procs[0].returncode, err, waited


def test_two_processes_equal_one_and_checkpoints_move_between_them(mesh_runs, killed_two_process_run, tmp_path):
    one_run = mesh_runs / "mesh"  # one process on the same 8 devices the two processes share; only read here
    two_run = killed_two_process_run[0]
    np.testing.assert_allclose(losses(two_run)[:2], losses(one_run)[:2], rtol=1e-5, atol=1e-5)

    # The step-2 checkpoint saved by the 2 processes, resumed by 1; the one saved by 1 process, resumed by 2
    # (the one-process run saved step 2 on its way to 3: a copy without step 3 is the run stopped there). The
    # resumed runs continue with the same losses and the same data position; their parameters differ from the
    # uninterrupted run's by at most an ulp, since gloo and XLA's in-process all-reduce sum in different orders.
    one_params, one_data = saved(one_run, 3)
    one = lambda run_dir, steps: train_single(run_dir, steps, 8, *MESH, SHARDS, HEARTBEAT)  # noqa: E731
    two = lambda run_dir, steps: train_multiprocess(run_dir, steps, *MESH, SHARDS)  # noqa: E731
    for saved_by, resume, name in ((two_run, one, "2to1"), (one_run, two, "1to2")):
        resumable_copy(saved_by, tmp_path / name, 2)
        resume(tmp_path / name, 3)
        np.testing.assert_allclose(losses(tmp_path / name), losses(one_run), rtol=1e-5, atol=1e-5)
        params, data = saved(tmp_path / name, 3)
        assert data == one_data, name
        for got, want in zip(params, one_params):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8, err_msg=name)


def test_a_dead_process_stops_the_others(killed_two_process_run):
    _, returncode, err, waited = killed_two_process_run
    assert returncode != 0, "the surviving process exited 0 after its peer died"
    assert waited < 120
    assert err.strip(), "the surviving process gave no message"
