"""Fixtures shared by the whole suite."""

from pathlib import Path

import pytest

from weir.shared.model_store import resolve_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face directory, downloaded and converted once."""
    return resolve_model(None)
