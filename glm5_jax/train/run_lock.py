"""One live run per run directory: `<run_dir>/run.lock` names the owner's pid, host and start time.

Two runs writing one directory delete each other's temporary checkpoints (orbax cleans them up on start) and
log every step twice, so a second run is refused while the owner lives. A lock whose owner died is stale and
taken over; a lock left by another host cannot be checked from here, so it is refused with how to clear it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = "run.lock"


class RunLockedError(RuntimeError):
    """Another live run owns the run directory."""


def _process_start_time(pid: int) -> str | None:
    """Kernel start time of `pid` (field 22 of /proc/<pid>/stat), to tell a reused pid from the owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class RunLock:
    """Context manager: take the lock of `run_dir` on entry (or raise RunLockedError), release it on exit.

    The owner keeps an exclusive `flock` on the file, which the kernel drops when the process dies however it
    dies (kill -9 included), so a lock that can be flocked was left by a dead owner: stale, and taken over.
    The pid/host/start time written into it are for the message and for hosts that share the directory.
    """

    def __init__(self, run_dir: str | Path, *, log=print, process_index: int = 0):
        # Each process of a multi-host run locks its own file, so their hosts never look like two runs.
        self.path = Path(run_dir) / (LOCK_NAME if process_index == 0 else f"{LOCK_NAME}.{process_index}")
        self.log = log
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(),
                      "process_start": _process_start_time(os.getpid()),
                      "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self._fd: int | None = None

    def _refuse(self, owner: dict, why: str) -> RunLockedError:
        return RunLockedError(
            f"run directory {self.path.parent} is in use by another run (pid {owner.get('pid')} on host "
            f"{owner.get('host')!r}, since {owner.get('started')}){why}; wait for it to finish, stop it, or use "
            "another train.run_dir")

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise self._refuse(owner, "") from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:  # else the owner released (unlinked) it between our open and flock: retry
                break
            os.close(fd)
        previous = _read_owner(fd)
        if previous and previous.get("host") not in (None, self.owner["host"]):
            os.close(fd)  # its flock may not reach us through a shared filesystem: cannot tell it is dead
            raise self._refuse(previous, f"; a lock from another host cannot be checked from here: if that run "
                                         f"is dead, delete {self.path}")
        if previous:
            self.log(f"took over the stale lock of {self.path.parent}: its owner (pid {previous.get('pid')}, "
                     f"since {previous.get('started')}) is gone")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.owner).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still flocked, so no one can have taken it meanwhile
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_owner(fd: int) -> dict:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}
