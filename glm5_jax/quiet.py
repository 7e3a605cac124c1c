"""Silencing what native libraries print where it says nothing to the user (libtpu describing a pod on a host
without TPUs, the CUDA plugin on a host without GPUs)."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def native_stderr_silenced():
    """Native code's writes to stderr (file descriptor 2) go nowhere inside; Python's own errors still raise."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
