"""glm5_jax: GLM-5 as a pure-function JAX model with a jitted training-step library."""

import glob
import importlib.util
import os
import sys
from pathlib import Path

from glm5_jax.quiet import native_stderr_silenced

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


def _quiet_cuda_plugin() -> None:
    """The CUDA plugin (the test extra installs it, for GPU AOT compiles) logs "Could not find cuda drivers on
    your machine" from native code each time jaxlib loads one of its libraries: three times while jax imports
    and once when jax discovers its plugins. Without a GPU that says nothing, so both run with native stderr
    silenced; the plugin is still registered, and compiling for a GPU topology works as before."""
    if _accelerator_present() or "jax" in sys.modules or importlib.util.find_spec("jax_cuda12_plugin") is None:
        return
    with native_stderr_silenced():
        from jax._src import xla_bridge
    discover = xla_bridge.discover_pjrt_plugins

    def discover_quietly() -> None:
        with native_stderr_silenced():
            discover()

    xla_bridge.discover_pjrt_plugins = discover_quietly


_cpu_only_without_accelerator()
_quiet_cuda_plugin()
