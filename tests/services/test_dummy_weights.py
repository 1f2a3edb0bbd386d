"""--load-format dummy: a model directory without weights serves random weights of its shape."""

import shutil

import pytest
import torch

from weir.services.executor.weights import load_model
from weir.services.launcher import ChildFailedError
from weir.services.llm import LLM
from weir.shared.model_store import ModelNotFoundError, resolve_model
from weir.shared.sampling import SamplingParams


@pytest.fixture(scope="module")
def weightless_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model's config and tokenizer, without its safetensors."""
    path = tmp_path_factory.mktemp("dummy") / "tiny-llama-shape"
    path.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, path / item.name)
    return path


def test_a_weightless_directory_is_a_model_only_for_dummy_loading(weightless_dir):
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors"):
        resolve_model(weightless_dir)
    assert resolve_model(weightless_dir, load_format="dummy") == weightless_dir.resolve()


def test_dummy_weights_have_the_checkpoint_shapes_and_are_the_same_every_time(
    weightless_dir, tiny_model_dir
):
    real = load_model(tiny_model_dir)
    dummy = load_model(weightless_dir, load_format="dummy")
    again = load_model(weightless_dir, load_format="dummy")
    real_params, dummy_params = dict(real.named_parameters()), dict(dummy.named_parameters())
    assert {n: p.shape for n, p in dummy_params.items()} == {
        n: p.shape for n, p in real_params.items()
    }
    for name, param in dummy_params.items():
        assert torch.isfinite(param).all(), name
        assert torch.equal(param, dict(again.named_parameters())[name]), name
        if "norm" in name:
            assert torch.all(param == 1), name
        else:
            assert 0.015 < param.std().item() < 0.025, name
    with pytest.raises(ValueError, match="load_format"):
        load_model(weightless_dir, load_format="random")


def test_llm_serves_dummy_weights_deterministically(weightless_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], "Hello there"]
    runs = []
    for _ in range(2):  # two servers: the same seeded weights in each executor process
        with LLM(str(weightless_dir), load_format="dummy", device="cpu") as llm:
            runs.append([c.token_ids for c in llm.generate(prompts, params)])
    assert [len(ids) for ids in runs[0]] == [6, 6]
    assert runs[0] == runs[1]


def test_serving_a_weightless_directory_without_dummy_says_what_is_missing(weightless_dir):
    with pytest.raises(ChildFailedError, match=r"\*\.safetensors"):
        LLM(str(weightless_dir), device="cpu", startup_timeout=120)
