"""Fixtures shared by the whole suite."""

import os
from pathlib import Path

import pytest

from weir.shared.model_store import resolve_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face directory, downloaded and converted once."""
    return resolve_model(None)


def pytest_configure(config) -> None:
    # Under pytest-xdist each worker gets a core of its own: executors size their OpenMP
    # threads from this process's affinity, and two unpinned workers' executors spin-waited on
    # each other's threads (a draft-model test took 245 s beside another run, 32 s alone);
    # pinned, a worker is a one-core machine.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})
