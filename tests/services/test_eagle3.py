"""EAGLE-3 speculative decoding (vLLM's ``eagle3``): heads over a 4-layer tiny Llama, read
from the served model's layer inputs, propose what an independent transformers reference of
the head proposes (a draft vocabulary smaller than the served model's, mapped through d2t),
outputs stay the served model's, and a head that does not fit is refused at start-up."""

import os
from types import SimpleNamespace

import pytest
import torch

# Triton's attention runs on CPU tensors under its interpreter (as test_eagle.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from conftest import save_tiny_llama, transformers
from safetensors.torch import load_file
from serving_helpers import check_llm_drafts, generate_in_core, hf_greedy
from spread_weights import spread_weights_
from test_eagle import GREEDY, engine, record_proposals, save_head

from weir.services.executor.eagle import Eagle3Head, aux_hidden_state_layers
from weir.shared.config import EngineArgs
from weir.shared.sampling import SamplingParams

# The layers whose inputs the heads read, listed out of order: vLLM concatenates them in
# the layers' order. Layer 0's input is the token's embedding.
AUX_LAYERS = [3, 0, 2]
# The 4-layer model's greedy outputs after the last two hold runs of three and four tokens.
PROMPTS = [list(range(100, 140)), [5, 6, 7, 8, 9], [7, 7, 7], [100, 100]]


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, default_model_dir):
    """The tiny Llama of conftest with 4 layers: three distinct layer inputs to read."""
    path = tmp_path_factory.mktemp("models") / "deep-llama"
    save_tiny_llama(path, default_model_dir, num_layers=4)
    return path


@pytest.fixture(scope="module")
def deep_hf_model(deep_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        deep_model_dir, dtype=torch.float32
    ).eval()


def head_config(target_config, draft_vocab_size: int, **keys):
    """An EAGLE-3 head's config.json over the served model: one layer of its shape."""
    config = target_config.to_dict()
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
        **keys,
    )
    return transformers.LlamaConfig(**config)


def random_head(config, draft_ids: torch.Tensor, seed: int = 2) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's tensors under yuhuili's names: fc, the midlayer (a Llama decoder
    layer whose q/k/v projections read 2 x hidden, and its hidden_norm), the final norm,
    an LM head over the draft vocabulary ``draft_ids`` (sorted target ids), d2t and t2d."""
    torch.manual_seed(seed)
    h = config.hidden_size
    layer = midlayer(config)
    with torch.no_grad():
        spread_weights_(layer)
    tensors = {f"midlayer.{name}": t for name, t in layer.state_dict().items()}
    tensors["norm.weight"] = 1 + 0.2 * torch.randn(h)
    tensors["lm_head.weight"] = 0.3 * torch.randn(len(draft_ids), h)
    tensors["fc.weight"] = 0.3 * torch.randn(h, 3 * h)
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    return tensors


def midlayer(config) -> torch.nn.Module:
    """transformers' Llama decoder layer with q/k/v reading 2 x hidden and a hidden_norm."""
    llama = transformers.models.llama.modeling_llama
    layer = llama.LlamaDecoderLayer(config, 0)
    h, d = config.hidden_size, config.head_dim
    attn = layer.self_attn
    attn.q_proj = torch.nn.Linear(2 * h, config.num_attention_heads * d, bias=False)
    attn.k_proj = torch.nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
    attn.v_proj = torch.nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
    layer.hidden_norm = llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)
    return layer


def draft_vocabulary(size: int, including: set[int] = frozenset()) -> torch.Tensor:
    """``size`` sorted target ids, ``including`` those: d2t's offsets grow along it."""
    generator = torch.Generator().manual_seed(5)
    others = torch.randperm(49152, generator=generator).tolist()
    ids = set(including)
    for i in others:
        if len(ids) == size:
            break
        ids.add(i)
    return torch.tensor(sorted(ids))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, deep_hf_model):
    path = tmp_path_factory.mktemp("heads") / "eagle3"
    ids = draft_vocabulary(512)
    config = head_config(deep_hf_model.config, len(ids))
    save_head(path, config, random_head(config, ids))
    return path


@pytest.fixture(scope="module")
def norm_first_head_dir(tmp_path_factory, deep_hf_model):
    """A random head with vLLM's norm_before_residual: its residual is the normed context."""
    path = tmp_path_factory.mktemp("heads") / "norm-first"
    ids = draft_vocabulary(512)
    config = head_config(deep_hf_model.config, len(ids), norm_before_residual=True)
    save_head(path, config, random_head(config, ids, seed=3))
    return path


@pytest.fixture(scope="module")
def copy_head_dir(tmp_path_factory, deep_hf_model):
    """A head whose output is the served model's embedding of the token before the one it
    reads (fc takes layer 0's input, the layer adds nothing, the LM head's rows are the
    draft tokens' embeddings scaled to unit length, so the argmax is that token): it
    proposes the token before the one just sampled, k times, which a run of one token
    keeps from its third token on. Its draft vocabulary holds every token of the prompts
    and greedy outputs."""
    path = tmp_path_factory.mktemp("heads") / "copy"
    seen = {t for p in PROMPTS for t in p + hf_greedy(deep_hf_model, p, GREEDY.max_tokens)}
    ids = draft_vocabulary(256, seen)
    config = head_config(deep_hf_model.config, len(ids))
    tensors = random_head(config, ids)
    h = config.hidden_size
    tensors["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, 2 * h)), dim=1)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        tensors[f"midlayer.{name}.weight"].zero_()
    rows = deep_hf_model.get_input_embeddings().weight[ids].detach()
    tensors["lm_head.weight"] = rows / rows.norm(dim=-1, keepdim=True)
    tensors["norm.weight"] = torch.ones(h)
    save_head(path, config, tensors)
    return path


class ReferenceHead:
    """An EAGLE-3 head in transformers' modules, as vLLM's Eagle3LlamaForCausalLM computes
    it, over the served model ``target``."""

    def __init__(self, target, head_dir) -> None:
        tensors = load_file(head_dir / "model.safetensors")
        config = transformers.LlamaConfig.from_pretrained(head_dir)
        config._attn_implementation = "eager"
        self.layer = midlayer(config).eval()
        layer = {
            name.removeprefix("midlayer."): t
            for name, t in tensors.items()
            if name.startswith("midlayer.")
        }
        self.layer.load_state_dict(layer)
        self.rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.norm.load_state_dict({"weight": tensors["norm.weight"]})
        self.fc, self.lm_head, self.d2t = (
            tensors[n] for n in ("fc.weight", "lm_head.weight", "d2t")
        )
        self.norm_before_residual = getattr(config, "norm_before_residual", False)
        self.layers = sorted(config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        self.target = target

    def pass_(self, tokens: list[int], context: torch.Tensor) -> torch.Tensor:
        """The midlayer's output before the final norm at every position of ``tokens``."""
        layer, n = self.layer, len(tokens)
        embeds = layer.input_layernorm(self.target.get_input_embeddings()(torch.tensor(tokens)))
        hidden = layer.hidden_norm(context)
        residual = hidden if self.norm_before_residual else context
        x = torch.cat((embeds, hidden), dim=-1)[None]
        position_embeddings = self.rotary(x, torch.arange(n)[None])
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        attn, _ = layer.self_attn(x, position_embeddings, causal)
        y = residual + attn[0]
        return y + layer.mlp(layer.post_attention_layernorm(y))

    @torch.no_grad()
    def drafts(self, prompt: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after the prompt: its first pass reads fc of the
        target's layer inputs (transformers' hidden_states[i] is layer i's input), each later
        one its own output at the position before."""
        out = self.target(torch.tensor([prompt]), output_hidden_states=True)
        token = int(out.logits[0, -1].argmax())  # the token the target samples
        aux = torch.cat([out.hidden_states[i][0] for i in self.layers], dim=-1)
        context = aux @ self.fc.T
        tokens = prompt[1:] + [token]
        drafts = []
        for _ in range(k):
            y = self.pass_(tokens, context)
            draft_id = int((self.norm(y[-1]) @ self.lm_head.T).argmax())
            draft = draft_id + int(self.d2t[draft_id])
            drafts.append(draft)
            tokens.append(draft)
            context = torch.cat((context, y[-1:]))
        return drafts


@pytest.mark.parametrize("head", ["random", "random-unpacked", "norm-first", "copy"])
def test_proposals_are_the_heads_as_transformers_computes_them(
    deep_model_dir,
    deep_hf_model,
    head_dir,
    norm_first_head_dir,
    copy_head_dir,
    head,
    monkeypatch,
):
    """Every step's drafts are the reference's of the sequence so far: after prefills in
    chunks of 16 and after verified steps (the copy head's drafts kept in runs of one
    token, so some steps keep 1 + 3 positions). Unpacked, the projections add into the
    residual stream in place, as on a GPU: the kept layer inputs must be copies."""
    if head == "random-unpacked":
        monkeypatch.setenv("WEIR_PACK_CPU_WEIGHTS", "0")
    directory = {
        "random": head_dir,
        "random-unpacked": head_dir,
        "norm-first": norm_first_head_dir,
        "copy": copy_head_dir,
    }
    core, runner = engine(deep_model_dir, directory[head], 3, method="eagle3")
    assert runner.drafter is not None and isinstance(runner.drafter.model, Eagle3Head)
    assert runner.model.aux_hidden_state_layers == (0, 2, 3)
    proposed = record_proposals(runner)
    outputs = generate_in_core(core, PROMPTS, GREEDY)
    assert outputs == [hf_greedy(deep_hf_model, p, GREEDY.max_tokens) for p in PROMPTS]
    assert len(proposed) > len(PROMPTS)
    reference = ReferenceHead(deep_hf_model, directory[head])
    for sequence, drafts in proposed:
        # The reference samples the sequence's last token itself.
        assert drafts == reference.drafts(sequence[:-1], len(drafts))
    if head == "copy":
        assert core.scheduler.stats().spec_decode.num_accepted_tokens >= 3
    else:  # d2t's offsets matter: some drafts are tokens past the draft vocabulary's size
        assert any(t >= 512 for _, drafts in proposed for t in drafts)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_greedy_outputs_are_the_served_models(deep_model_dir, deep_hf_model, head_dir, graphs):
    """Prompts longer than a chunk, four at a time, 3 drafts a step: transformers' greedy
    tokens. With the CUDA graphs' padded buffers (run eagerly on a CPU) the head reads a
    decode graph's auxiliary rows."""
    prompts = [list(range(100, 140)), [5, 6, 7, 8], list(range(300, 320)), [9, 9, 9, 9, 9]]
    core, runner = engine(deep_model_dir, head_dir, 3, method="eagle3")
    shapes = []
    if graphs:
        runner.capture_graphs(capture=False)
        assert runner.graphs is not None
        forward = runner.graphs.forward

        def recording(shape):
            shapes.append(shape)
            outputs = forward(shape)
            assert outputs[1] is not None and outputs[1].shape[1] == 3 * 32
            return outputs

        runner.graphs.forward = recording  # type: ignore[method-assign]
    outputs = generate_in_core(core, prompts, GREEDY)
    assert outputs == [hf_greedy(deep_hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert core.scheduler.stats().spec_decode.num_draft_tokens > 0
    assert bool(shapes) == graphs


def test_triton_attention_warms_up_the_heads_kernels_too(deep_model_dir, deep_hf_model, head_dir):
    """With Triton's attention (interpreted on a CPU) the start-up warms the head's layer
    up through its own pass (zero rows of three layers' width), and outputs stay
    transformers'."""
    prompt = [5, 6, 7, 8, 9]
    core, _ = engine(deep_model_dir, head_dir, 2, method="eagle3", attention_backend="triton")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert generate_in_core(core, [prompt], params) == [hf_greedy(deep_hf_model, prompt, 4)]


def test_dummy_weights_draft(deep_model_dir, head_dir):
    """load_format dummy: the head's weights random, d2t zeros (draft ids are target ids)."""
    core, runner = engine(deep_model_dir, head_dir, 2, method="eagle3", load_format="dummy")
    assert runner.drafter is not None and isinstance(runner.drafter.model, Eagle3Head)
    assert not runner.drafter.model.d2t.any()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(generate_in_core(core, [[5, 6, 7, 8, 9]], params)[0]) == 4
    assert core.scheduler.stats().spec_decode.num_draft_tokens > 0


def test_llm_with_an_eagle3_config(deep_model_dir, deep_hf_model, head_dir):
    """vLLM's speculative_config through the processes: outputs are transformers', and
    the head drafted."""
    config = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2}
    check_llm_drafts(deep_model_dir, deep_hf_model, config)


def _without(name):
    return lambda config, tensors: tensors.pop(name)


def _replace(name, tensor):
    return lambda config, tensors: tensors.__setitem__(name, tensor)


def _configure(**keys):
    return lambda config, tensors: config.update(keys)


@pytest.mark.parametrize(
    "change, message",
    [
        (_without("d2t"), "no d2t"),
        (_without("lm_head.weight"), "no lm_head.weight"),
        (_without("fc.weight"), "no fc.weight"),
        (
            _replace("fc.weight", torch.zeros(32, 64)),
            r"fc.weight of shape \(32, 64\), not \(32, 96\)",
        ),
        (_replace("d2t", torch.full((512,), 49152)), "d2t maps draft tokens outside"),
        (_replace("eagle_fc.weight", torch.zeros(1)), "unexpected tensor 'eagle_fc.weight'"),
        (_configure(hidden_size=48, head_dim=12), "hidden_size 48 is not the served model's 32"),
        (_configure(target_hidden_size=64), "target_hidden_size 64 is not the served model's 32"),
        (_configure(num_hidden_layers=2), "num_hidden_layers 2; an EAGLE-3 head of one layer"),
        (_configure(model_type="mistral"), "model_type is 'mistral'"),
        (
            _configure(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}),
            r"layers \[1, 2, 4\] are not distinct layers of the served model's 4",
        ),
        (
            _configure(eagle_config={"use_aux_hidden_state": False}),
            "without auxiliary hidden states is not supported",
        ),
    ],
)
def test_a_head_that_does_not_fit_is_refused(
    deep_model_dir, deep_hf_model, tmp_path, change, message
):
    ids = draft_vocabulary(512)
    config = head_config(deep_hf_model.config, len(ids))
    tensors = random_head(config, ids)
    changed = config.to_dict()
    change(changed, tensors)
    save_head(tmp_path / "head", SimpleNamespace(to_dict=lambda: changed), tensors)
    with pytest.raises(ValueError, match=message):
        engine(deep_model_dir, tmp_path / "head", 2, method="eagle3")


def test_the_aux_layers_default_to_vllms():
    """(2, n // 2, n - 3) without ids; a head's own, top-level or in eagle_config, sorted."""
    assert aux_hidden_state_layers("h", {}, 32) == (2, 16, 29)
    ids = {"eagle_aux_hidden_state_layer_ids": [20, 1, 9]}
    assert aux_hidden_state_layers("h", ids, 32) == (1, 9, 20)
    assert aux_hidden_state_layers("h", {"eagle_config": ids}, 32) == (1, 9, 20)
    with pytest.raises(ValueError, match=r"\[2, 2, 1\] are not distinct layers"):
        aux_hidden_state_layers("h", {}, 4)


@pytest.mark.parametrize(
    "options",
    [
        {
            "speculative_config": {
                "method": "eagle3",
                "model": "/heads/x",
                "num_speculative_tokens": 3,
            }
        },
        {
            "speculative_method": "eagle3",
            "speculative_model": "/heads/x",
            "num_speculative_tokens": 3,
        },
    ],
)
def test_eagle3_options(options):
    args = EngineArgs(**options)
    assert (args.speculative_method, args.speculative_model) == ("eagle3", "/heads/x")
    config = args.scheduler_config(100)
    assert (config.num_speculative_tokens, config.num_lookahead_tokens) == (3, 3)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"speculative_method": "eagle3"}, "eagle3 needs speculative_model"),
        (
            {"speculative_method": "eagle3", "speculative_model": "x", "tensor_parallel_size": 2},
            "eagle3 under tensor parallelism is not supported",
        ),
        (
            {
                "speculative_method": "eagle3",
                "speculative_model": "x",
                "speculative_model_quantization": "int8",
            },
            "an EAGLE head is not quantized",
        ),
    ],
)
def test_eagle3_options_refused_before_start(options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**options)
