"""A Hub repo id as the model (`weir serve org/name`, as `vllm serve` takes one): the snapshot
that `huggingface-cli download` left in the Hugging Face cache, laid out here as
huggingface_hub lays it out (refs/main naming the commit, the snapshot's files symbolic links
into blobs/), served under the repo id's name."""

import os
import shutil

import openai
import pytest
from serving_helpers import hf_greedy, small_server

from weir.services.llm import LLM
from weir.shared.config import EngineArgs
from weir.shared.hub_cache import cached_snapshot, model_name_of, resolve_hub_ids
from weir.shared.model_store import ModelNotFoundError, resolve_model
from weir.shared.sampling import SamplingParams

REPO = "acme/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir, monkeypatch):
    """An HF cache holding ``REPO`` (the tiny Llama) at ``COMMIT``; $HF_HUB_CACHE names it
    (the server's processes inherit it)."""
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(tiny_model_dir.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def test_a_repo_id_names_its_cached_snapshot_and_is_served_under_its_name(
    hub_cache, tiny_model_dir, tiny_hf_model
):
    assert cached_snapshot(REPO) == hub_cache
    assert resolve_model(REPO) == hub_cache.resolve()
    assert model_name_of(hub_cache) == REPO and model_name_of(tiny_model_dir) == "tiny-llama"
    # vLLM's --tokenizer and --speculative-model take a repo id too.
    args = EngineArgs(model=str(tiny_model_dir), tokenizer=REPO, speculative_model=REPO)
    assert args.tokenizer == args.speculative_model == str(hub_cache)
    # No --served-model-name: the API calls it by its repo id, as vLLM does.
    with small_server(REPO, "", served_model_name=()) as server:
        client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="-")
        assert [m.id for m in client.models.list().data] == [REPO]
        reply = client.completions.create(
            model=REPO,
            prompt=[5, 6, 7, 8],
            max_tokens=6,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    assert reply.choices[0].token_ids == hf_greedy(tiny_hf_model, [5, 6, 7, 8], 6)


def test_a_repo_id_the_cache_lacks_says_to_download_it(hub_cache, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="huggingface-cli download acme/other"):
        resolve_model("acme/other")
    (hub_cache.parent.parent / "refs" / "main").write_text("f" * 40)  # a commit not there
    assert cached_snapshot(REPO) is None
    # A path is a path: one that does not exist is not looked up as a repo id.
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("./acme/tiny-chat")
    assert "huggingface-cli" not in str(caught.value)


def test_vllms_download_dir_is_the_cache_a_repo_id_is_read_from(hub_cache, monkeypatch):
    from weir.services.cli import _engine_args, parse_args

    cache = hub_cache.parent.parent.parent
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(cache / "elsewhere"))
    assert cached_snapshot(REPO) is None
    args = _engine_args(
        parse_args(["serve", REPO, "--download-dir", str(cache), "--tokenizer", REPO])
    )
    # The tokenizer is the model's own (vLLM's default), so none apart.
    assert (args.model, args.tokenizer) == (str(hub_cache), None)


def test_vllms_revision_reads_that_snapshot_and_refuses_one_the_cache_lacks(hub_cache, capsys):
    from weir.services.cli import _engine_args, parse_args

    repo = hub_cache.parent.parent
    other = "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(hub_cache, repo / "snapshots" / other, symlinks=True)
    (repo / "refs" / "v2").write_text(other)
    for revision in ("v2", other):
        args = _engine_args(parse_args(["serve", REPO, "--revision", revision]))
        assert args.model == str(repo / "snapshots" / other)
    assert _engine_args(parse_args(["serve", REPO, "--revision", "main"])).model == str(hub_cache)
    tokenizer = _engine_args(parse_args(["serve", REPO, "--tokenizer-revision", "v2"])).tokenizer
    assert tokenizer == str(repo / "snapshots" / other)  # the model's tokenizer, at v2
    with pytest.raises(SystemExit) as exit_info:
        _engine_args(parse_args(["serve", REPO, "--revision", "v3"]))
    assert exit_info.value.code == 2
    assert "huggingface-cli download acme/tiny-chat --revision v3" in capsys.readouterr().err


def test_llm_takes_vllms_revision_and_download_dir(hub_cache, tiny_hf_model):
    """vLLM's LLM(model, revision=..., download_dir=...): the same snapshot resolution as
    the command line's (``hub_cache.resolve_hub_ids``); one the cache lacks is refused
    before any process starts."""
    repo = hub_cache.parent.parent
    (repo / "refs" / "v2").write_text(COMMIT)
    assert resolve_hub_ids({"model": REPO}, revision="v2") == {"model": str(hub_cache)}
    with pytest.raises(ValueError, match="huggingface-cli download acme/tiny-chat --revision v9"):
        LLM(REPO, revision="v9")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cache = str(repo.parent)
    with LLM(REPO, revision="v2", download_dir=cache, device="cpu") as llm:
        [completion] = llm.generate([[5, 6, 7, 8]], greedy)
    assert completion.token_ids == hf_greedy(tiny_hf_model, [5, 6, 7, 8], 4)
