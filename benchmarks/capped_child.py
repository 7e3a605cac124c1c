"""Run one benchmark measurement in a child process under a memory cap, and report its peak resident memory.

Why a child per measurement: peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss`) only means something for a process
that ran one side at one length, and a side that does not fit must fail on its own instead of waking the
kernel's OOM killer on a machine shared with others.

The guard is `RLIMIT_AS` (address space), set in the child before jax, XLA or torch is imported. Checked on
this machine (jax 0.10.2 CPU, torch 2.13 CPU): both run normally under a 9 GiB cap, and an allocation past it
fails cleanly inside the process (XLA: `RESOURCE_EXHAUSTED: Out of memory`, torch: `DefaultCPUAllocator: can't
allocate memory`), so no RSS watchdog is needed. Such failures, and aborts whose stderr names an allocation
failure, are reported as status "does_not_fit" at the cap.

Child side:  python -m benchmarks.capped_child MODULE:FUNCTION SPEC.json CAP_GIB
  sets the cap, imports MODULE, calls FUNCTION(spec dict) -> dict, and prints one JSON line:
  {"status": "ok", ...the dict..., "peak_rss_bytes": N} (or status "does_not_fit" with the error).
Parent side: `run_capped(target, spec, cap_gib, timeout_s)` returns that dict (or a "does_not_fit" / "timeout"
  / "error" record built from the exit status and stderr).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# Messages that mean "an allocation failed" in XLA, torch, the C++ runtime and glibc under RLIMIT_AS.
_OUT_OF_MEMORY_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "can't allocate memory",
                          "Cannot allocate memory", "MemoryError", "std::bad_alloc", "Resource temporarily unavailable",
                          "failed to allocate", "Failed to allocate")


def set_memory_cap(cap_gib: float) -> None:
    cap = int(cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def is_out_of_memory(text: str) -> bool:
    return any(marker in text for marker in _OUT_OF_MEMORY_MARKERS)


def _tail(text: str, chars: int = 600) -> str:
    lines = [line for line in text.strip().splitlines() if "libtpu" not in line and "TPU" not in line]
    return "\n".join(lines)[-chars:]


def run_capped(target: str, spec: dict, cap_gib: float, timeout_s: float) -> dict:
    """Run `target` ("module:function") on `spec` in a child capped at `cap_gib`; return its record."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
        spec_path = handle.name
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "benchmarks.capped_child", target, spec_path, str(cap_gib)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "cap_gib": cap_gib, "error": f"no result within {timeout_s:.0f} s"}
    finally:
        os.unlink(spec_path)
    records = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and records:
        return json.loads(records[-1])
    if is_out_of_memory(done.stderr + done.stdout):
        return {"status": "does_not_fit", "cap_gib": cap_gib, "returncode": done.returncode,
                "error": _tail(done.stderr, 300)}
    return {"status": "error", "cap_gib": cap_gib, "returncode": done.returncode, "error": _tail(done.stderr)}


def _child_main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m benchmarks.capped_child MODULE:FUNCTION SPEC.json CAP_GIB", file=sys.stderr)
        return 2
    target, spec_path, cap = argv
    cap_gib = float(cap)
    set_memory_cap(cap_gib)  # before anything large is imported or mapped
    import importlib

    module_name, function_name = target.split(":")
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = getattr(importlib.import_module(module_name), function_name)(spec)
    except MemoryError as error:
        result = {"status": "does_not_fit", "error": f"MemoryError: {error}"[:300]}
    except Exception as error:  # XLA and torch raise their own types for a failed allocation
        if not is_out_of_memory(str(error)):
            raise
        result = {"status": "does_not_fit", "error": f"{type(error).__name__}: {error}"[:300]}
    else:
        result = {"status": "ok", **result}
    result.update(cap_gib=cap_gib, peak_rss_bytes=peak_rss_bytes())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
