"""glm5_jax: GLM-5 as a pure-function JAX model with a jitted training-step library."""

import glob
import os
import sys
from pathlib import Path

__version__ = "0.1.0"

# Devices whose presence means jax should look for an accelerator: NVIDIA GPUs (as jax itself checks), AMD
# GPUs, and TPU chips (their character devices, or PCI devices of class "processing accelerator").
_ACCELERATOR_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/accel0",
                             "/dev/vfio/0")


def _accelerator_present() -> bool:
    if any(os.path.exists(path) for path in _ACCELERATOR_DEVICE_FILES):
        return True
    return any(Path(path).read_text().startswith("0x12") for path in glob.glob("/sys/bus/pci/devices/*/class"))


def _cpu_only_without_accelerator() -> None:
    """With neither a TPU nor a GPU present, run jax on CPU only. Left to itself, jax would initialise every
    installed backend at first use: libtpu (the test extra brings it, for AOT compiles) prints "Failed to find
    host bounds for accelerator type" and "unexpected worker hostname" errors, and the CUDA plugin a "Unable
    to load CUDA" traceback. Compiling for a described TPU or GPU topology (`glm5 compile`) still works, and
    an explicit JAX_PLATFORMS always wins."""
    if "JAX_PLATFORMS" in os.environ or _accelerator_present():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported before us: its config has read the environment already
        sys.modules["jax"].config.update("jax_platforms", "cpu")


_cpu_only_without_accelerator()
