"""`glm5 train` on a device mesh over several processes (jax.distributed over 127.0.0.1, gloo collectives): the
same losses and parameters as one device, checkpoints that move between one device and the mesh both ways, and
a clean failure when a process dies. Every run is a `glm5 train` subprocess with its own fake CPU device count."""

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
# Small enough to compile in seconds; every feature of tiny.yaml (MoE, DSA top-k, MTP) stays on, with one dense and
# one MoE layer and one MTP step (15% less CPU per run than tiny.yaml's depths).
BASE = ["configs/tiny.yaml", "train.seq_len=64", "train.batch_size=8", "train.log_every=1", "data.max_files=4",
        "data.validation_fraction=0", "checkpoint.every=2", "model.index_topk=8", "model.num_hidden_layers=2",
        "model.mtp_num_steps=1"]
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
HEARTBEAT = "distributed.heartbeat_timeout_s=10"  # the survivor of a dead peer gives up within seconds
STEPS = 5  # checkpoints at steps 2, 4 and 5
# The mesh's sharded matmuls and gloo's all-reduces may sum in other orders than one device does: parameters
# after a step on the mesh are held to an ulp or so of one device's.
MESH_PARAMS = dict(rtol=1e-6, atol=1e-8)


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    """5 steps on one device: the reference of the two-process mesh run, which resumes its step-2 checkpoint
    and whose step-4 checkpoint one device resumes in turn."""
    run_dir = tmp_path_factory.mktemp("one") / "one"
    train_single(run_dir, STEPS, 1, SHARDS, HEARTBEAT)
    return run_dir


def resumable_copy(source: Path, target: Path, step: int) -> None:
    """A copy of a finished run's directory that holds checkpoints up to `step` only: resuming it continues from
    `step` exactly as the interrupted run would (the runner drops metrics logged after the restored step)."""
    shutil.copytree(source, target)
    for saved_step in (target / "checkpoints").iterdir():
        if saved_step.name.isdigit() and int(saved_step.name) > step:
            shutil.rmtree(saved_step)


@pytest.fixture(scope="module")
def killed_two_process_run(one_run, tmp_path_factory):
    """Two processes of 4 devices each resume the one-device run's step-2 checkpoint on an 8-device mesh and
    train on until they have saved step 4, when one of them is killed: (run directory, the survivor's exit code,
    its stderr, seconds it took to exit). One job of two processes serves four checks (a checkpoint moving from
    one device to a mesh over two processes, the mesh's steps against one device's, their checkpoint resumed on
    one device, the survivor's failure): each such job compiles its training step in both processes, since they
    cannot share the compile cache."""
    run_dir = tmp_path_factory.mktemp("killed") / "two"
    resumable_copy(one_run, run_dir, 2)
    procs = start_processes(run_dir, 400, *MESH, SHARDS, HEARTBEAT)
    try:
        metrics, checkpoint = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "4"
        deadline = time.monotonic() + TIMEOUT
        while not (checkpoint.is_dir() and metrics.read_text().count("\n") >= 4):
            assert time.monotonic() < deadline, "the processes never saved step 4"
            assert all(proc.poll() is None for proc in procs), procs[0].stderr.read()[-4000:]
            time.sleep(1)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        waited = time.monotonic() - killed_at
    finally:
        _kill_all(procs)
    return run_dir, procs[0].returncode, err, waited


def test_a_mesh_over_two_processes_equals_one_device_and_checkpoints_move_between_them(
        one_run, killed_two_process_run, tmp_path):
    two_run = killed_two_process_run[0]
    params_close = lambda got, want, name: [  # noqa: E731
        np.testing.assert_allclose(g, w, **MESH_PARAMS, err_msg=name) for g, w in zip(got, want)]

    # 1 -> 2: the checkpoint one device saved at step 2, resumed by two processes on an 8-device mesh, gives one
    # device's steps 3 and 4, its step-4 parameters and the same data position.
    np.testing.assert_allclose(losses(two_run)[:4], losses(one_run)[:4], rtol=1e-5, atol=1e-5)
    (two_params, two_data), (one_params, one_data) = saved(two_run, 4), saved(one_run, 4)
    assert two_data == one_data
    params_close(two_params, one_params, "1to2")

    # 2 -> 1: the checkpoint the two processes saved at step 4, resumed on one device (the reference run's step,
    # loaded from the compile cache), gives one device's step 5.
    resumable_copy(two_run, tmp_path / "2to1", 4)
    train_single(tmp_path / "2to1", STEPS, 1, SHARDS, HEARTBEAT)
    np.testing.assert_allclose(losses(tmp_path / "2to1"), losses(one_run), rtol=1e-5, atol=1e-5)
    (params, data), (one_params, one_data) = saved(tmp_path / "2to1", STEPS), saved(one_run, STEPS)
    assert data == one_data
    params_close(params, one_params, "2to1")


def test_a_dead_process_stops_the_others(killed_two_process_run):
    _, returncode, err, waited = killed_two_process_run
    assert returncode != 0, "the surviving process exited 0 after its peer died"
    assert waited < 120
    assert err.strip(), "the surviving process gave no message"
