"""libtpu (brought by the test extra) takes a machine-wide lock file when it starts; AOT compiles for TPU need
no TPU, so let several test processes on one CI host load it at once."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
