"""Session fixtures for the generation tests: parameters and the plain greedy run most tests compare with."""

import pytest
from generation_setup import CONFIG, SHARED_CONFIG, random_params, run_greedy


@pytest.fixture(scope="session")
def params():
    return random_params(CONFIG, seed=0)


@pytest.fixture(scope="session")
def shared_params():
    return random_params(SHARED_CONFIG, seed=1)


@pytest.fixture(scope="session")
def greedy_output(params):
    return run_greedy(params, CONFIG)
