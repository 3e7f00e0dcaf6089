"""Fixtures of the training tests: the tiny random Gemma 3 target and datasets distilled from it."""

import pytest

from tests.training.distilled import greedy_rows, write_dataset


@pytest.fixture(scope="session")
def target(random_checkpoints):
    return random_checkpoints["gemma3"]


@pytest.fixture(scope="session")
def rows(target):
    return greedy_rows(target)


@pytest.fixture(scope="session")
def online_data(target, rows, tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "online", rows, target)


@pytest.fixture(scope="session")
def offline_data(target, rows, tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("data") / "offline", rows, target, features="float32")


@pytest.fixture(scope="session", autouse=True)
def persistent_compile_cache():
    """What `specdec train` does: compiled programs go to specdec's XLA cache, so the runs of one config
    (several tests, a subprocess) compile once."""
    from specdec import compile_cache

    compile_cache.enable_jax()
