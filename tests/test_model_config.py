"""A model directory's config.json and weights are read as transformers reads them, and
one that does not describe its weights (or is malformed) is one clear error, never a
model built from a slice of each tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from weir.services.executor.weights import load_model
from weir.shared.model_config import (
    QWEN_HYBRID_TYPES,
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    read_model_config,
)

transformers = pytest.importorskip("transformers")

import hf_auto_classes  # noqa: E402, F401

REQUIRED = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
)
GEMMA = {"model_type": "gemma3_text", **REQUIRED}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_keys_left_out_take_transformers_defaults_for_the_model_type(model_type):
    # gpt-oss' and Llama 4's default 8 KV heads would outnumber the 4 query heads
    required = (
        {**REQUIRED, "num_key_value_heads": 2}
        if model_type in ("gpt_oss", "llama4_text")
        else REQUIRED
    )
    if model_type == "deepseek_v2":  # transformers' default is none, which its router cannot take
        required = {**REQUIRED, "num_experts_per_tok": 2}
    if model_type in (
        "ministral",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
    ):  # default head_dim None fails
        required = {**REQUIRED, "head_dim": 16}
    if model_type in QWEN_HYBRID_TYPES:  # two layers would default to linear attention alone
        required = {**required, "num_hidden_layers": 4}
    ours = ModelConfig.from_hf({"model_type": model_type, **required})
    theirs = transformers.AutoConfig.for_model(model_type, **required, pad_token_id=0)
    mla = ours.latent_attention
    if model_type == "gemma4_text":  # head sizes and KV heads of each layer's own
        for i in range(theirs.num_hidden_layers):
            layer, mine = theirs.per_layer_config[i], ours.for_layer(i)
            assert (mine.head_dim, mine.num_kv_heads) == (layer.head_dim, layer.num_key_value_heads)
        assert ours.for_layer(1).head_dim == 512 and ours.for_layer(0).head_dim == 256
    elif mla is None:
        assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)
    else:  # the cached row: the latent and the rotated channels
        shape = (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        )
        assert [getattr(mla, key) for key in shape] == [getattr(theirs, key) for key in shape]
        assert ours.head_dim == theirs.kv_lora_rank + theirs.qk_rope_head_dim
    if hasattr(theirs, "n_routed_experts"):  # DeepSeek's experts (GLM's too)
        assert ours.num_experts == theirs.n_routed_experts
        model = transformers.AutoModelForCausalLM.from_config(theirs)
        sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
        assert ours.moe_layers == tuple(sparse)
        shared = theirs.n_shared_experts * theirs.moe_intermediate_size
        assert ours.shared_expert_intermediate_size == shared
        # transformers' head_dim: DeepSeek's rotated channels, Mistral 4's qk_head_dim
        assert ours.rope.rotary_dim == int(
            (theirs.head_dim if mla else ours.head_dim)
            * theirs.rope_parameters.get("partial_rotary_factor", 1.0)
        )
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    eps = ("rms_norm_eps", "layer_norm_eps", "norm_epsilon")  # Cohere's, Starcoder2's
    assert ours.rms_norm_eps == next(getattr(theirs, k) for k in eps if hasattr(theirs, k))
    rope = theirs.rope_parameters
    assert ours.rope.theta == rope.get("full_attention", rope)["rope_theta"]
    assert ours.rope.type == rope.get("full_attention", rope)["rope_type"]  # gpt-oss': YaRN
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert _windows(ours) == _windows_of(transformers.AutoModelForCausalLM.from_config(theirs))
    if model_type in (
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "gpt_oss",
        "olmoe",
        "granitemoe",
        "granitemoeshared",
        "minimax_m2",
        "qwen3_5_moe_text",
        "qwen3_next",
    ):
        experts = getattr(theirs, "num_experts", None) or theirs.num_local_experts
        assert (ours.num_experts, ours.num_experts_per_tok) == (experts, theirs.num_experts_per_tok)
        assert ours.moe_intermediate_size == (
            theirs.moe_intermediate_size
            if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "qwen3_next")
            else theirs.intermediate_size
        )
        assert ours.moe_layers == tuple(range(required["num_hidden_layers"]))
        assert ours.norm_topk_prob == getattr(theirs, "norm_topk_prob", True)
        shared = getattr(theirs, "shared_expert_intermediate_size", None) or 0
        assert ours.shared_expert_intermediate_size == shared
    elif model_type == "ernie4_5_moe":  # its experts from moe_layer_start_index on
        model = transformers.AutoModelForCausalLM.from_config(theirs)
        sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
        assert ours.moe_layers == tuple(sparse) == (1,)
        assert (ours.num_experts, ours.num_experts_per_tok) == (
            theirs.moe_num_experts,
            theirs.moe_k,
        )
        shared = theirs.moe_num_shared_experts * theirs.moe_intermediate_size
        assert ours.shared_expert_intermediate_size == shared
    elif model_type == "llama4_text":  # experts and a shared expert of intermediate_size
        assert ours.moe_layers == tuple(theirs.moe_layers) == (0, 1)
        assert (ours.num_experts, ours.num_experts_per_tok) == (
            theirs.num_local_experts,
            theirs.num_experts_per_tok,
        )
        assert ours.moe_intermediate_size == ours.shared_expert_intermediate_size == 96
        assert ours.intermediate_size == theirs.intermediate_size_mlp
        assert ours.nope_layers == tuple(i for i, r in enumerate(theirs.no_rope_layers) if not r)
        # Chunks bound the attention of the layers transformers chunks, not the context.
        assert ours.context_len == theirs.max_position_embeddings
        chunked = [t == "chunked_attention" for t in theirs.layer_types]
        assert [ours.layer_chunk(i) is not None for i in range(ours.num_layers)] == chunked
        assert {ours.layer_chunk(i) for i in range(ours.num_layers)} - {None} == {
            theirs.attention_chunk_size
        }
    elif model_type == "hunyuan_v1_moe":  # every layer's experts and shared MLP
        assert (ours.num_experts, ours.num_experts_per_tok) == (1, theirs.moe_topk) == (1, 1)
        assert ours.moe_layers == (0, 1)
        assert ours.moe_intermediate_size == ours.shared_expert_intermediate_size == 96
    elif not hasattr(theirs, "n_routed_experts"):
        assert ours.num_experts == 0 and ours.moe_layers == ()


def _windows(ours: ModelConfig) -> list[int | None]:
    return [ours.layer_window(i) for i in range(ours.num_layers)]


def _windows_of(model) -> list[int | None]:
    """The sliding window each of transformers' layers applies (0 or None: none): by the
    config's layer_types where the model picks its masks by them (Qwen2, Qwen3, Qwen2-MoE,
    Gemma 3), else every layer's own or, where it keeps none (Mistral, Mixtral, Phi-3), the
    config's it passes on."""
    window = getattr(model.config, "sliding_window", None) or None
    types = getattr(model.config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [
        getattr(layer.self_attn, "sliding_window", window) or None for layer in model.model.layers
    ]


@pytest.mark.parametrize(
    "model_type, keys",
    [
        ("mistral", {"sliding_window": None}),  # Mistral v0.2 and later
        ("mistral", {"sliding_window": 64}),
        ("mixtral", {"sliding_window": 128}),
        ("phi3", {"sliding_window": 40}),
        ("qwen2", {"use_sliding_window": True}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 3}),
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 2,
            },
        ),
        ("qwen3", {"sliding_window": 32}),  # not used without use_sliding_window
        ("qwen3", {"use_sliding_window": True, "max_window_layers": 2}),
        ("qwen2_moe", {"use_sliding_window": True, "max_window_layers": 4}),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}),
        ("gemma2", {"sliding_window": 256}),
        ("gemma3_text", {"sliding_window": 512}),
        ("gemma3_text", {"sliding_window_pattern": 2}),
        (
            "gemma3_text",
            {"layer_types": ["full_attention", "sliding_attention"] * 2 + ["full_attention"]},
        ),
        ("gpt_oss", {"num_key_value_heads": 2}),
        ("gpt_oss", {"num_key_value_heads": 2, "sliding_window": 64}),
        ("smollm3", {"sliding_window": 32}),  # not used without use_sliding_window
        ("smollm3", {"use_sliding_window": True, "sliding_window": 32}),  # on the NoPE layer
        (
            "smollm3",
            {"use_sliding_window": True, "sliding_window": 32, "no_rope_layers": [0, 1] * 2 + [0]},
        ),
        ("smollm3", {"use_sliding_window": True}),  # no window given: none
        ("exaone4", {}),  # 4096 on all but every fourth layer
        ("exaone4", {"sliding_window": 64, "sliding_window_pattern": 2}),
        ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 5}),  # 1.2B's
        ("cohere2", {}),
        ("cohere2", {"sliding_window": 64, "sliding_window_pattern": 2}),
        ("ministral", {"head_dim": 16}),  # transformers' attention fails on its None
        ("ministral", {"head_dim": 16, "sliding_window": None}),
        ("ministral3", {}),
        ("ministral3", {"sliding_window": 32}),
    ],
)
def test_the_sliding_windows_are_the_ones_transformers_applies(model_type, keys):
    """Per layer, as transformers' attention modules hold them."""
    hf = {"model_type": model_type, **REQUIRED, "num_hidden_layers": 5, **keys}
    ours = ModelConfig.from_hf(hf)
    theirs = transformers.AutoConfig.for_model(**hf, pad_token_id=0)
    assert _windows(ours) == _windows_of(transformers.AutoModelForCausalLM.from_config(theirs))


@pytest.mark.parametrize(
    "keys", [{}, {"no_rope_layer_interval": 2}, {"no_rope_layers": [0, 1, 1, 0, 1]}]
)
def test_smollm3_rotates_the_layers_transformers_rotates(keys):
    hf = {"model_type": "smollm3", **REQUIRED, "num_hidden_layers": 5, **keys}
    theirs = transformers.AutoConfig.for_model(**hf, pad_token_id=0)
    nope = tuple(i for i, rotated in enumerate(theirs.no_rope_layers) if not rotated)
    assert ModelConfig.from_hf(hf).nope_layers == nope


@pytest.mark.parametrize(
    "model_type, keys",
    [
        ("exaone4", {}),
        ("exaone4", {"sliding_window_pattern": 2}),
        ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 5}),
        ("cohere2", {}),
        ("cohere2", {"sliding_window_pattern": 2}),
        ("cohere2", {"sliding_window": None}),
    ],
)
def test_global_layers_rotate_as_transformers_rotates_them(model_type, keys):
    """EXAONE 4's global layers rotate nothing where it has local ones (the 32B's), all where
    not; Cohere 2's local layers alone rotate, and only with a window."""
    hf = {"model_type": model_type, **REQUIRED, "num_hidden_layers": 5, **keys}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
    attns = [layer.self_attn for layer in model.model.layers]
    if model_type == "exaone4":
        rotated = [a.sliding_window is None or a.is_sliding for a in attns]
    else:
        rotated = [a.sliding_window is not None for a in attns]
    nope = tuple(i for i, r in enumerate(rotated) if not r)
    assert ModelConfig.from_hf(hf).nope_layers == nope


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo3"])
@pytest.mark.parametrize(
    "keys",
    [{}, {"rope_theta": 1234.0}, {"rope_theta": 1234.0, "rope_local_base_freq": 99.0}],
)
def test_sliding_layers_rotate_by_the_base_transformers_gives_them(model_type, keys):
    """Gemma 3's local base, and OLMo 3's sliding layers' default base even beside a legacy
    rope_theta (which transformers gives its full layers only)."""
    hf = {"model_type": model_type, **REQUIRED, "num_hidden_layers": 4, **keys}
    theirs = transformers.AutoConfig.for_model(**hf, pad_token_id=0).rope_parameters
    ours = ModelConfig.from_hf(hf)
    assert ours.rope.theta == theirs["full_attention"]["rope_theta"]
    assert ours.sliding_rope.theta == theirs["sliding_attention"]["rope_theta"]


def test_a_key_that_only_llama_has_is_ignored_elsewhere():
    """transformers' Qwen2 has no MLP biases, whatever the file says."""
    hf = {"model_type": "qwen2", **REQUIRED, "mlp_bias": True}
    assert not ModelConfig.from_hf(hf).mlp_bias


def test_legacy_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    hf = {
        "model_type": "llama",
        **REQUIRED,
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    assert ModelConfig.from_hf(hf).rope.factor == 2.0
    assert transformers.LlamaConfig(**hf).rope_parameters["factor"] == 2.0


CLASSIFIER = {
    "model_type": "llama",
    **REQUIRED,
    "architectures": ["LlamaForSequenceClassification"],
}


def test_a_classifier_has_its_labels_or_those_of_its_tokens():
    causal = {**CLASSIFIER, "architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_hf(causal).num_labels == 0
    assert ModelConfig.from_hf({**causal, "num_labels": 5}).num_labels == 0
    assert ModelConfig.from_hf(CLASSIFIER).num_labels == 2  # transformers' default
    labels = {"0": "a", "1": "b", "2": "c"}
    assert ModelConfig.from_hf({**CLASSIFIER, "id2label": labels}).num_labels == 3
    reranker = {**CLASSIFIER, "classifier_from_token": ["no", "yes"]}
    assert ModelConfig.from_hf(reranker).num_labels == 2
    two_way = ModelConfig.from_hf({**reranker, "is_original_qwen3_reranker": True})
    assert (two_way.num_labels, two_way.two_way_softmax) == (1, True)
    assert ModelConfig.from_hf({**reranker, "method": "from_2_way_softmax"}).two_way_softmax


@pytest.mark.parametrize(
    "hf, message",
    [
        ([1, 2], "must hold a JSON object, not a list"),
        ({}, "unsupported model_type None"),
        ({"model_type": "llama"}, "config.json has no 'hidden_size'"),
        ({**REQUIRED, "vocab_size": "100"}, "vocab_size must be a positive integer, got '100'"),
        ({**REQUIRED, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({**REQUIRED, "num_key_value_heads": 3}, "4 is not a multiple of num_key_value_heads 3"),
        ({**REQUIRED, "rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
        ({**REQUIRED, "rope_scaling": "linear"}, "rope_scaling must be an object"),
        ({**REQUIRED, "partial_rotary_factor": 0.5}, "partial rotary embeddings are supported"),
        (
            {"model_type": "phi3", **REQUIRED, "partial_rotary_factor": 0.1},
            "rotates 1 of 16 channels",
        ),
        ({**REQUIRED, "rope_scaling": {"rope_type": "dynamic"}}, "unsupported rope type 'dynamic'"),
        ({**REQUIRED, "head_dim": 15}, "head_dim 15 is odd"),
        (
            {**REQUIRED, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}},
            "long_factor must list 8 positive numbers",
        ),
        (
            {
                **REQUIRED,
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 7,
                    "long_factor": [1.0] * 8,
                },
            },
            "short_factor must list 8 positive numbers",
        ),
        (
            {**REQUIRED, "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": -1}},
            "beta_fast must be a positive number",
        ),
        ({**REQUIRED, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({**REQUIRED, "hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({**GEMMA, "hidden_activation": "relu"}, "unsupported hidden_activation 'relu'"),
        # The experts and the packed CPU kernels fuse SiLU: GELU is Gemma's alone.
        (
            {**REQUIRED, "model_type": "qwen3_moe", "hidden_act": "gelu_pytorch_tanh"},
            "unsupported hidden_act 'gelu_pytorch_tanh'",
        ),
        ({**GEMMA, "final_logit_softcapping": 0}, "final_logit_softcapping must be a positive"),
        (
            {**GEMMA, "model_type": "gemma2", "attn_logit_softcapping": "50"},
            "attn_logit_softcapping must be a positive",
        ),
        ({**GEMMA, "use_bidirectional_attention": True}, "use_bidirectional_attention is not"),
        (
            {"model_type": "mistral3", "text_config": {**REQUIRED, "model_type": "llama"}},
            "a mistral3 checkpoint's text_config of model_type 'llama' is not supported",
        ),
        (
            {**REQUIRED, "model_type": "olmoe", "clip_qkv": 8.0},
            "clip_qkv (queries, keys and values clamped) is not",
        ),
        ({**GEMMA, "layer_types": ["full_attention"]}, "layer_types must name"),
        ({**GEMMA, "layer_types": ["sliding", "full"]}, "layer_types must name"),
        ({**REQUIRED, "model_type": "smollm3", "no_rope_layers": [1]}, "no_rope_layers must be"),
        ({**REQUIRED, "model_type": "smollm3", "no_rope_layers": [1, 2]}, "no_rope_layers must be"),
        (
            {**GEMMA, "rope_parameters": {"sliding_attention": {"rope_type": "linear"}}},
            "unsupported rope type 'linear' of the sliding layers",
        ),
        ({**CLASSIFIER, "classifier_from_token": "yes"}, "classifier_from_token must be tokens"),
        (
            {
                **CLASSIFIER,
                "classifier_from_token": ["a", "b", "c"],
                "method": "from_2_way_softmax",
            },
            "with method 'from_2_way_softmax' is not read",
        ),
        ({**CLASSIFIER, "classifier_from_token": ["a"], "method": "mean"}, "method 'mean'"),
        ({**CLASSIFIER, "num_labels": 0}, "num_labels must be a positive integer"),
    ],
)
def test_a_malformed_config_is_a_value_error_naming_the_key(hf, message):
    if isinstance(hf, dict) and hf and "model_type" not in hf:
        hf = {"model_type": "llama", **hf}
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf(hf)
    assert message in str(error.value)


def test_read_model_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: not valid JSON"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=f"{tmp_path}: config.json has no 'hidden_size'"):
        read_model_config(tmp_path)
    with pytest.raises(ValueError, match="a path holds no NUL character"):
        read_model_config(f"{tmp_path}/\x00")


def _save_llama(path, attention_bias: bool = False, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **REQUIRED, num_key_value_heads=2, attention_bias=attention_bias
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, **save_kwargs)
    return model


@pytest.mark.parametrize(
    "change",
    [
        {"intermediate_size": 80},
        {"num_key_value_heads": 1},
        {"num_attention_heads": 2, "head_dim": 16},
        {"vocab_size": 90},
        {"num_hidden_layers": 1},
        {"attention_bias": False, "mlp_bias": True},  # checkpoint of attention biases only
    ],
)
def test_a_config_that_does_not_describe_the_weights_is_refused(tmp_path, change):
    """transformers refuses these too; reading the first rows of each tensor would serve a
    different model without a word."""
    _save_llama(tmp_path, attention_bias="attention_bias" in change)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match="the config does not describe these weights"):
        load_model(tmp_path)


def test_a_tensor_repeated_in_another_file_is_refused_even_where_it_hides_a_missing_one(
    tmp_path,
):
    """Two files without an index: v_proj missing from the first, k_proj (as large) again
    in the second; the element count alone would come out right."""
    _save_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    save_file({n: w for n, w in weights.items() if n != v}, tmp_path / "model-1.safetensors")
    save_file({k: weights[k]}, tmp_path / "model-2.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{k}' appears twice"):
        load_model(tmp_path)


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    """Files beside the shards (an adapter, a stale single-file copy) are not weights."""
    reference = _save_llama(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    save_file({"base_model.lora_A.weight": torch.ones(2)}, tmp_path / "adapter_model.safetensors")
    save_file({"model.norm.weight": torch.zeros(64)}, tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert torch.equal(model.embed_tokens, reference.model.embed_tokens.weight)
    assert torch.equal(model.norm.weight, reference.model.norm.weight)


def test_a_single_file_checkpoint_ignores_other_safetensors_files(tmp_path):
    reference = _save_llama(tmp_path)
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "copy.bak")  # not *.safetensors
    save_file({"base_model.lora_A.weight": torch.ones(2)}, tmp_path / "adapter_model.safetensors")
    model = load_model(tmp_path)
    assert torch.equal(model.embed_tokens, reference.model.embed_tokens.weight)


def test_unreadable_weight_files_are_a_value_error_naming_the_file(tmp_path):
    """One line from the executor, not a safetensors traceback."""
    _save_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_model(tmp_path)
    weights.unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"x": "nope.safetensors"}}'
    )
    with pytest.raises(ValueError, match=r"names files that are not there: \['nope.safetensors'\]"):
        load_model(tmp_path)


def test_a_gemma3_multimodal_config_as_the_hub_writes_it_reads_as_transformers_does():
    """google/gemma-3-4b-it's config.json: text_config lists only what differs from
    Gemma3TextConfig's defaults, and the whole model's flags sit beside it."""
    text = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    hf = {"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}
    ours = ModelConfig.from_hf(hf)
    theirs = transformers.Gemma3Config(text_config=text).text_config
    assert ours.multimodal and ours.tie_word_embeddings
    assert (ours.vocab_size, ours.hidden_size, ours.num_layers) == (
        theirs.vocab_size,
        theirs.hidden_size,
        theirs.num_hidden_layers,
    )
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
    )
    assert ours.attention_multiplier == theirs.query_pre_attn_scalar**-0.5
    full, local = (
        theirs.rope_parameters["full_attention"],
        theirs.rope_parameters["sliding_attention"],
    )
    assert (ours.rope.theta, ours.rope.type, ours.rope.factor) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
    )
    assert ours.sliding_rope is not None
    assert ours.sliding_rope.theta == local["rope_theta"]
    assert _windows(ours) == [
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    ]


def test_minimax_m2_reads_the_keys_of_its_released_files():
    """MiniMax-M2's config.json gives each head's rotated channels as rotary_dim (read as
    transformers reads it) and its multi-token prediction modules, whose layers are not
    read."""
    hf = {
        "model_type": "minimax_m2",
        **REQUIRED,
        "head_dim": 16,
        "rotary_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "use_mtp": True,
        "num_mtp_modules": 3,
    }
    theirs = transformers.AutoConfig.for_model(**hf)
    ours = ModelConfig.from_hf(hf)
    rotated = theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"]
    assert ours.rope.rotary_dim == rotated == 8
    assert ours.num_nextn_predict_layers == 3


def test_kimi_k2_reads_as_deepseek_v3():
    """Kimi K2's config.json (Instruct, Thinking) names model_type kimi_k2 for DeepSeek-V3's
    architecture, as vLLM and transformers read it."""
    hf = {**REQUIRED, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
    kimi = ModelConfig.from_hf({**hf, "model_type": "kimi_k2"})
    assert kimi == ModelConfig.from_hf({**hf, "model_type": "deepseek_v3"})
