"""`glm5 ...` run inside the test process, returned as `cli_subprocess.run_glm5` returns a subprocess.

A subprocess pays for importing Python, JAX and the package (several CPU seconds) and re-traces every program
it runs; in the test process the imports are done once and programs the session compiled are found in the
compilation cache. Used wherever nothing needs a fresh process (a device count, a crash, a second live run)."""

import contextlib
import io
import subprocess

from xla_env import REPO

from glm5_jax.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`glm5 ARGS` in this process, from the checkout's root as the subprocess runs it, stdout and stderr
    captured; an argparse error (SystemExit) becomes its exit code as in a process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return subprocess.CompletedProcess(["glm5", *args], code, out.getvalue(), err.getvalue())
