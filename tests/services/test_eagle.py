"""EAGLE speculative decoding (vLLM's ``eagle``): a random EAGLE-1 head over the tiny Llama
proposes what an independent transformers reference of the head proposes, outputs stay the
served model's, and a head that does not fit is refused at start-up."""

import json
import os

import pytest
import torch

# Triton's attention runs on CPU tensors under its interpreter, which Triton reads when the
# kernel module is first imported (lazily, by get_attention_backend), as test_model_core.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from conftest import transformers
from safetensors.torch import save_file
from serving_helpers import (
    check_llm_drafts,
    drafting_core,
    generate_in_core,
    hf_greedy,
)
from spread_weights import spread_weights_

from weir.services.executor.model_runner import ModelRunner
from weir.services.llm import LLM
from weir.shared.config import EngineArgs
from weir.shared.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def head_config(tiny_hf_model, hidden_size: int | None = None):
    """The config.json of an EAGLE-1 head of the tiny Llama: one layer of its shape."""
    config = tiny_hf_model.config.to_dict()
    config.update(num_hidden_layers=1)
    if hidden_size is not None:
        config.update(hidden_size=hidden_size, head_dim=hidden_size // 4)
    return transformers.LlamaConfig(**config)


def save_head(path, config, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config.to_dict()))


def random_head(config, prefix: str = "") -> dict[str, torch.Tensor]:
    """An EAGLE-1 head's tensors: fc, a decoder layer without its input norm, and an
    embedding (which the served model's replaces)."""
    torch.manual_seed(2)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    with torch.no_grad():
        spread_weights_(layer)
    h = config.hidden_size
    tensors = {
        f"{prefix}layers.0.{name}": t
        for name, t in layer.state_dict().items()
        if not name.startswith("input_layernorm")
    }
    tensors[f"{prefix}fc.weight"] = 0.3 * torch.randn(h, 2 * h)
    tensors[f"{prefix}embed_tokens.weight"] = torch.zeros(config.vocab_size, h)
    return tensors


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, tiny_hf_model):
    path = tmp_path_factory.mktemp("heads") / "eagle"
    config = head_config(tiny_hf_model)
    save_head(path, config, random_head(config, prefix="model."))
    return path


@pytest.fixture(scope="module")
def copy_head_dir(tmp_path_factory, tiny_hf_model):
    """A head whose output is its context row (fc takes the hidden half, the layer adds
    nothing): it proposes the target's own prediction at the position before, the token
    just sampled, so the tiny model's runs of one token keep its drafts."""
    path = tmp_path_factory.mktemp("heads") / "copy"
    config = head_config(tiny_hf_model)
    tensors = random_head(config)
    h = config.hidden_size
    tensors["fc.weight"] = torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        tensors[f"layers.0.{name}.weight"].zero_()
    save_head(path, config, tensors)
    return path


def engine(
    model_dir, head_dir, k: int, max_num_batched_tokens: int = 16, method="eagle", **options
):
    """An engine core of ``model_dir`` with ``k`` drafts a step of the EAGLE head of
    ``method``, and its runner (``options``: more of ModelRunner's)."""
    runner = ModelRunner(
        model_dir,
        device="cpu",
        kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
        num_speculative_tokens=k,
        speculative_model=head_dir,
        speculative_method=method,
        **options,
    )
    return drafting_core(runner, k, max_num_batched_tokens), runner


def record_proposals(runner) -> list[tuple[list[int], list[int]]]:
    """The list the runner's drafter appends each proposal to from now on: (the request's
    sequence so far, its drafts)."""
    proposed: list[tuple[list[int], list[int]]] = []
    propose = runner.drafter.propose

    def recording(batch, inputs, sampled, hidden):
        drafts = propose(batch, inputs, sampled, hidden)
        for rid, row in drafts.items():
            slot = inputs.slots[inputs.req_ids.index(rid)]
            proposed.append((batch.token_ids[slot, : batch.num_tokens[slot]].tolist(), row))
        return drafts

    runner.drafter.propose = recording
    return proposed


def reference_drafts(tiny_hf_model, head_dir, prompt: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after the prompt, in transformers: a 1-layer LlamaModel
    of the head's layer (input norm and final norm Identity) fed fc(embedding of the
    shifted tokens, the target's final hidden states), the target's LM head on its output."""
    from safetensors.torch import load_file

    tensors = {
        name.removeprefix("model."): t
        for name, t in load_file(head_dir / "model.safetensors").items()
    }
    config = transformers.LlamaConfig.from_pretrained(head_dir)
    head = transformers.LlamaModel(config).eval()
    layer = {name: t for name, t in tensors.items() if name.startswith("layers.")}
    loaded = head.load_state_dict(layer, strict=False)
    # Only what the head has no use for is left unloaded (Identity below, or unused).
    unused = {"embed_tokens.weight", "layers.0.input_layernorm.weight", "norm.weight"}
    assert set(loaded.missing_keys) == unused and not loaded.unexpected_keys
    head.layers[0].input_layernorm = torch.nn.Identity()
    head.norm = torch.nn.Identity()
    fc = tensors["fc.weight"]
    embed = tiny_hf_model.get_input_embeddings()
    with torch.no_grad():
        out = tiny_hf_model(torch.tensor([prompt]), output_hidden_states=True)
        token = int(out.logits[0, -1].argmax())  # the token the target samples
        context = out.hidden_states[-1][0]  # after the final norm: what its LM head read
        tokens = prompt[1:] + [token]
        drafts = []
        for _ in range(k):
            x = torch.cat((embed(torch.tensor(tokens)), context), dim=-1) @ fc.T
            y = head(inputs_embeds=x[None]).last_hidden_state[0]
            draft = int(tiny_hf_model.lm_head(y[-1]).argmax())
            drafts.append(draft)
            # The next pass: the draft with the head's own output at the position before.
            tokens.append(draft)
            context = torch.cat((context, y[-1:]))
    return drafts


@pytest.mark.parametrize("head", ["random", "copy"])
def test_proposals_are_the_heads_as_transformers_computes_them(
    tiny_model_dir, tiny_hf_model, head_dir, copy_head_dir, head
):
    """Every step's drafts are the reference's of the sequence so far: after prefills in
    chunks of 16 (the head computing each chunk as it comes) and after verified steps,
    the head's cache recomputed over the kept positions only (the copy head's drafts are
    kept in a run of one token, so some steps keep 1 + 3 positions)."""
    directory = head_dir if head == "random" else copy_head_dir
    prompts = [list(range(100, 140)), [5, 6, 7, 8, 9], [9, 9, 9, 9, 9]]
    core, runner = engine(tiny_model_dir, directory, 3)
    assert runner.drafter is not None
    proposed = record_proposals(runner)
    generate_in_core(core, prompts, GREEDY)
    assert len(proposed) > len(prompts)
    for sequence, drafts in proposed:
        # The reference samples the sequence's last token itself.
        assert drafts == reference_drafts(tiny_hf_model, directory, sequence[:-1], len(drafts))
    if head == "copy":
        assert core.scheduler.stats().spec_decode.num_accepted_tokens >= 3


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_greedy_outputs_are_the_served_models(tiny_model_dir, tiny_hf_model, head_dir, graphs):
    """Prompts longer than a chunk, four at a time, with 3 drafts a step: transformers'
    greedy tokens, and drafts were proposed. With the CUDA graphs' padded buffers (run
    eagerly on a CPU), the head reads a decode graph's rows; mixed steps run eagerly."""
    prompts = [list(range(100, 140)), [5, 6, 7, 8], list(range(300, 320)), [9, 9, 9, 9, 9]]
    core, runner = engine(tiny_model_dir, head_dir, 3)
    shapes = []
    if graphs:
        runner.capture_graphs(capture=False)
        assert runner.graphs is not None
        forward = runner.graphs.forward

        def recording(shape):
            shapes.append(shape)
            return forward(shape)

        runner.graphs.forward = recording  # type: ignore[method-assign]
    outputs = generate_in_core(core, prompts, GREEDY)
    assert outputs == [hf_greedy(tiny_hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert core.scheduler.stats().spec_decode.num_draft_tokens > 0
    assert bool(shapes) == graphs and not any(shape.mixed for shape in shapes)


def test_triton_attention_warms_up_the_heads_kernels_too(tiny_model_dir, tiny_hf_model, head_dir):
    """With Triton's attention (interpreted on a CPU) the start-up warms the head's layer up
    through its own pass (its context rows zero), and outputs stay transformers'."""
    prompt = [5, 6, 7, 8, 9]
    core, _ = engine(tiny_model_dir, head_dir, 2, attention_backend="triton")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert generate_in_core(core, [prompt], params) == [hf_greedy(tiny_hf_model, prompt, 4)]


def test_llm_with_an_eagle_config(tiny_model_dir, tiny_hf_model, head_dir):
    """vLLM's speculative_config through the processes: outputs are transformers', and
    the head drafted."""
    config = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 2}
    check_llm_drafts(tiny_model_dir, tiny_hf_model, config)


def test_a_head_that_does_not_fit_is_refused(tiny_model_dir, tiny_hf_model, tmp_path):
    wide = head_config(tiny_hf_model, hidden_size=48)
    save_head(tmp_path / "wide", wide, random_head(wide))
    with pytest.raises(ValueError, match="hidden_size 48 is not the served model's 32"):
        engine(tiny_model_dir, tmp_path / "wide", 2)
    config = head_config(tiny_hf_model)
    tensors = random_head(config)
    del tensors["fc.weight"]
    save_head(tmp_path / "no-fc", config, tensors)
    with pytest.raises(ValueError, match="no fc.weight"):
        engine(tiny_model_dir, tmp_path / "no-fc", 2)


def test_a_wide_head_fails_the_servers_start_up(tiny_model_dir, tiny_hf_model, tmp_path):
    """Through the processes: the executor's refusal is the start-up's one line."""
    from weir.services.launcher import ChildFailedError

    wide = head_config(tiny_hf_model, hidden_size=48)
    save_head(tmp_path / "wide", wide, random_head(wide))
    config = {"method": "eagle", "model": str(tmp_path / "wide"), "num_speculative_tokens": 2}
    with pytest.raises(ChildFailedError, match="hidden_size 48 is not the served model's 32"):
        LLM(str(tiny_model_dir), device="cpu", speculative_config=config, startup_timeout=120)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"speculative_method": "eagle"}, "eagle needs speculative_model"),
        # LLM(...)'s and a config file's method, which argparse's choices do not see.
        ({"speculative_method": "medusa", "num_speculative_tokens": 2}, "must be one of"),
        (
            {"speculative_method": "eagle", "speculative_model": "x", "tensor_parallel_size": 2},
            "eagle under tensor parallelism is not supported",
        ),
    ],
)
def test_eagle_options_refused_before_start(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)


def test_the_scheduler_gives_eagle_drafts_lookahead_slots():
    """The head writes its KV past the last computed token, as a draft model does."""
    args = EngineArgs(
        speculative_config={"method": "eagle", "model": "/heads/x", "num_speculative_tokens": 3}
    )
    assert (args.speculative_method, args.speculative_model) == ("eagle", "/heads/x")
    config = args.scheduler_config(100)
    assert (config.num_speculative_tokens, config.num_lookahead_tokens) == (3, 3)
