"""The measured test times that order the suite over the xdist workers (tests/slowest_tests.json, read by
tests/conftest.py) name tests that exist, whole: a name cut short (as a node id with a space in its parameters once
was) or a renamed test would count as unmeasured and could start last, holding up the end of the run."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_measured_time_names_a_test_that_exists():
    measured = json.loads((REPO / "tests" / "slowest_tests.json").read_text())
    assert measured and all(seconds > 0 for seconds in measured.values())
    for node_id in measured:
        path, _, test = node_id.partition("::")
        name, bracket, params = test.partition("[")
        assert (REPO / path).is_file(), node_id
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), node_id
        assert not bracket or params.endswith("]"), f"cut short: {node_id}"
