"""experiments/seeds.py: per-seed folders, mean and min-max, paired differences, curve bands."""

import pytest

from experiments.seeds import band, format_spread, paired_spread, rolling_mean, seed_dirs, spread


def test_spread_gives_mean_min_max_and_the_values():
    figure = spread({0: 0.5, 1: 0.2, 2: 0.8})
    assert figure["mean"] == pytest.approx(0.5)
    assert (figure["min"], figure["max"], figure["n"]) == (0.2, 0.8, 3)
    assert figure["per_seed"] == {"0": 0.5, "1": 0.2, "2": 0.8}
    assert format_spread(figure) == "0.500 (0.200-0.800)"


def test_spread_refuses_a_missing_or_non_finite_value():
    with pytest.raises(ValueError, match=r"seeds \[1\]"):
        spread({0: 0.5, 1: None})
    with pytest.raises(ValueError, match=r"seeds \[2\]"):
        spread({0: 0.5, 2: float("nan")})
    with pytest.raises(ValueError, match="at least one"):
        spread({})


def test_paired_spread_differences_seed_by_seed():
    # Between seeds a moves by 0.4, but within each seed a - b is 0.1 or 0.2.
    figure = paired_spread({0: 0.3, 1: 0.7}, {0: 0.2, 1: 0.5})
    assert figure["mean"] == pytest.approx(0.15)
    assert (figure["min"], figure["max"]) == (pytest.approx(0.1), pytest.approx(0.2))
    with pytest.raises(ValueError, match="same seeds"):
        paired_spread({0: 1.0, 1: 2.0}, {0: 1.0})


def test_band_stacks_the_steps_every_seed_has():
    curves = band({0: {1: 1.0, 2: 2.0, 3: 3.0}, 1: {1: 3.0, 2: 0.0}})
    assert curves == {"step": [1, 2], "mean": [2.0, 1.0], "min": [1.0, 0.0], "max": [3.0, 2.0]}


def test_rolling_mean_is_trailing():
    assert rolling_mean({1: 1.0, 2: 3.0, 3: 5.0, 4: 7.0}, 2) == {1: 1.0, 2: 2.0, 3: 4.0, 4: 6.0}


def test_seed_dirs_finds_seed_folders_in_order(tmp_path):
    for name in ("seed_10", "seed_2", "plots", "seed_x"):
        (tmp_path / name).mkdir()
    (tmp_path / "seed_3").write_text("a file, not a folder")
    assert list(seed_dirs(tmp_path)) == [2, 10]
    with pytest.raises(FileNotFoundError, match="run.sh"):
        seed_dirs(tmp_path / "plots")
