"""benchmarks/ab_libraries.py keeps two checkouts of the package apart in one process."""

import sys
from pathlib import Path

import pytest

import glm5_jax
from benchmarks.ab_libraries import Library, parse_args, ratio_summary

ROOT = Path(__file__).resolve().parents[2]


def test_two_checkouts_load_side_by_side_and_leave_the_callers_package_alone():
    before, after = Library(str(ROOT), "before"), Library(str(ROOT), "after")
    assert before.modules["glm5_jax"] is not after.modules["glm5_jax"]
    assert before.make_train_step is not after.make_train_step
    assert before.make_train_step.__module__ == "glm5_jax.train.step"
    assert sys.modules["glm5_jax"] is glm5_jax  # the caller's own copy, before and after each load
    with before.active():
        assert sys.modules["glm5_jax.train.step"] is before.modules["glm5_jax.train.step"]
        with after.active():
            assert sys.modules["glm5_jax.train.step"] is after.modules["glm5_jax.train.step"]
        assert sys.modules["glm5_jax.train.step"] is before.modules["glm5_jax.train.step"]
    assert sys.modules["glm5_jax"] is glm5_jax


def test_ratios_pair_each_round_and_bad_arguments_are_named(tmp_path):
    summary = ratio_summary([1.0, 2.0, 4.0], [1.1, 2.0, 3.6])
    assert summary["median_of_pair_ratios"] == 1.0 and summary["ratio_of_medians"] == 1.0
    assert summary["pairs"] == 3
    with pytest.raises(SystemExit):
        parse_args(["--before", str(tmp_path)])  # no glm5_jax/ there
    with pytest.raises(SystemExit):
        parse_args(["--before", str(ROOT), "--steps", "0"])
