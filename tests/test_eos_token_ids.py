"""End-of-sequence tokens: the scheduler stops on the same set the executor bans before
min_tokens, even where a model's files name different ones."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from weir.services.engine.frontend import ClientFrontend
from weir.services.engine.metrics import SchedulerMetrics
from weir.services.executor.input_batch import InputBatch
from weir.services.executor.sampler import Sampler, SamplingBatch
from weir.shared.model_config import eos_token_ids
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol.step import NewRequest
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CONFIG_EOS, GENERATION_EOS, TOKENIZER_EOS = 0, 7, 2  # "<|endoftext|>", a plain token, "<|im_end|>"


def _set_eos(path: Path, eos: object) -> None:
    data = json.loads(path.read_text())
    data["eos_token_id"] = eos
    path.write_text(json.dumps(data))


@pytest.fixture
def disagreeing_model_dir(default_model_dir: Path, tmp_path: Path) -> Path:
    """The default model's files (no weights: none is read) with three different ends."""
    for name in MODEL_FILES:
        shutil.copy(default_model_dir / name, tmp_path / name)
    _set_eos(tmp_path / "config.json", CONFIG_EOS)
    _set_eos(tmp_path / "generation_config.json", [GENERATION_EOS])
    return tmp_path


def _scheduler_request(model_dir: Path, params: SamplingParams):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    frontend = ClientFrontend(
        None,
        tokenizer,
        tokenizer.vocab_size,
        512,
        SchedulerMetrics("eos-test"),
        wake=lambda: None,
        requests_ended=lambda: None,
        health=lambda stream_ids: {},
        model_info=lambda: {},
    )
    try:
        request = client_protocol.GenerateRequest("r", [1, 2, 3], params)
        return frontend._new_request("r", [1, 2, 3], request, 0.0)
    finally:
        frontend.close()


def _banned(model_dir: Path, params: SamplingParams) -> set[int]:
    batch = InputBatch(64, 16, 2, eos_token_ids(model_dir))
    batch._add(NewRequest("r", [1, 2, 3], params, [0], 0))
    return set(batch.stop_ids.get(batch.slot_of["r"], np.array([], np.int64)).tolist())


def test_the_default_model_has_one_end_token(default_model_dir: Path) -> None:
    assert eos_token_ids(default_model_dir) == (TOKENIZER_EOS,)


def test_every_files_end_token_counts(disagreeing_model_dir: Path) -> None:
    ids = {CONFIG_EOS, GENERATION_EOS, TOKENIZER_EOS}
    assert set(eos_token_ids(disagreeing_model_dir)) == ids
    assert set(Tokenizer.from_model_dir(disagreeing_model_dir).stop_token_ids) == ids


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_executor_bans_every_end_before_min_tokens_and_the_scheduler_stops_on_them(
    disagreeing_model_dir: Path, ignore_eos: bool
) -> None:
    """Under ignore_eos the model's ends do not stop a request, but min_tokens still bans
    them, as vLLM's does (its stop set always holds the model's end)."""
    params = SamplingParams(min_tokens=4, stop_token_ids=(9,), ignore_eos=ignore_eos)
    request = _scheduler_request(disagreeing_model_dir, params)
    ends = {9, CONFIG_EOS, GENERATION_EOS, TOKENIZER_EOS}
    assert request.stop_ids == ({9} if ignore_eos else ends)
    # The executor gets the parameters the scheduler sends (with the ends it added).
    assert _banned(disagreeing_model_dir, request.sampling_params) == ends


def test_no_end_token_is_sampled_before_min_tokens(disagreeing_model_dir: Path) -> None:
    request = _scheduler_request(disagreeing_model_dir, SamplingParams(min_tokens=4))
    banned = sorted(_banned(disagreeing_model_dir, request.sampling_params))
    logits = torch.zeros(64, 50)
    logits[:, banned] = 10.0  # the end tokens are by far the likeliest
    rows = np.ones(64, np.float32)
    batch = SamplingBatch.build(
        rows,
        np.zeros(64, np.int64),
        rows,
        np.zeros(64, np.float32),
        device="cpu",
        banned=[(row, banned) for row in range(64)],
    )
    tokens = Sampler(seed=0)(logits, batch).token_ids
    assert not set(tokens.tolist()) & set(banned)


@pytest.mark.parametrize("eos", ["2", True, [2, None]])
def test_an_end_token_that_is_not_an_id_is_named(disagreeing_model_dir: Path, eos: object) -> None:
    _set_eos(disagreeing_model_dir / "generation_config.json", eos)
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be token ids"):
        eos_token_ids(disagreeing_model_dir)
