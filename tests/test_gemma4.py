"""Gemma 4's language model beside what tests/test_architectures.py decodes of it: its config
read as transformers reads it, whether written as Google's files write it (global_head_dim,
num_global_key_value_heads) or as transformers 5.2x saves it (per_layer_config), and what
Weir refuses; a KV cache only for the layers that keep their own (the sharing layers read an
earlier layer's, the same tensor), of each layer's own head size; the multimodal checkpoint's
language model."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tp_workload  # noqa: E402
from lora_adapters import greedy  # noqa: E402
from paged_requests import BLOCK_SIZE, NUM_BLOCKS, PagedRequests  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402
from test_architectures import CONFIGS, VOCAB, _adapter, save_model  # noqa: E402

from weir.services.executor.weights import load_model  # noqa: E402
from weir.shared.lora import check_adapter  # noqa: E402
from weir.shared.model_config import ModelConfig, read_model_config  # noqa: E402
from weir.shared.shard_layout import ShardLayout  # noqa: E402

# Google's files: the full-attention layers' shapes as two keys of their own.
HUB_STYLE = dict(
    model_type="gemma4_text",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
)


def test_config_reads_each_layer_as_transformers_does(tmp_path):
    """transformers saves HUB_STYLE's full-attention shapes as per_layer_config: Weir reads
    both files alike, and each layer as transformers builds it (its head size, KV heads and
    whether its values are its keys; the layer whose KV a sharing layer reads)."""
    theirs = transformers.Gemma4TextConfig(
        **{k: v for k, v in HUB_STYLE.items() if k != "model_type"}
    )
    model = transformers.Gemma4ForCausalLM(theirs)
    model.save_pretrained(tmp_path)
    saved = read_model_config(tmp_path)
    assert saved == ModelConfig.from_hf(HUB_STYLE)
    for i, layer in enumerate(model.model.layers):
        attention, mine = layer.self_attn, saved.for_layer(i)
        assert mine.head_dim == attention.head_dim
        assert mine.num_kv_heads * attention.num_key_value_groups == 4
        assert mine.values_from_keys == attention.use_alternative_attention
        assert (saved.kv_source(i) != i) == attention.is_kv_shared_layer
    # Layers 4 and 5 read the last sliding and full layers before them, 3 and 2.
    assert saved.kv_sources == (0, 1, 2, 3, 3, 2)
    assert saved.cache_layers == (0, 1, 2, 3)
    assert saved.sliding_layers == (0, 1, 3, 4)
    assert (saved.rope.type, saved.rope.rotary_dim, saved.rope.proportion) == (
        "proportional",
        32,
        0.25,
    )
    assert saved.sliding_rope is not None and saved.sliding_rope.rotary_dim == 16
    # Left out: transformers' defaults (five sliding layers to one full, 512-wide full heads).
    bare = ModelConfig.from_hf({"model_type": "gemma4_text", "num_hidden_layers": 7})
    assert bare.sliding_layers == (0, 1, 2, 3, 4) and bare.global_head_dim == 512
    assert bare.per_layer_input_size == 256 and not bare.kv_sources


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all'"),
        ({"num_kv_shared_layers": 6}, "must leave at least one of the 6 layers"),
        ({"num_kv_shared_layers": 4}, "kinds must each appear among the layers before"),
        ({"per_layer_config": {"0": {"head_dim": 32}}}, r"per_layer_config\['0'\]"),
        (
            {"per_layer_config": {"2": {"head_dim": 32}, "5": {"head_dim": 64}}},
            "every full-attention layer the same",
        ),
        ({"per_layer_config": {"2": {"sliding_window": 4}}}, "only the full-attention"),
    ],
)
def test_what_weir_refuses_of_a_config(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**HUB_STYLE, **changes})


def test_tensor_parallelism_must_fit_the_full_layers_kv_heads_too():
    cfg = ModelConfig.from_hf(
        {**HUB_STYLE, "num_global_key_value_heads": 3, "num_attention_heads": 6}
    )
    with pytest.raises(ValueError, match="does not fit the model's 3 KV heads"):
        ShardLayout.of(cfg, 0, 2)


def test_only_the_layers_with_their_own_kv_keep_a_cache(tmp_path):
    save_model("gemma4_text", tmp_path)
    model = load_model(tmp_path)
    caches = model.allocate_kv_caches(8, 16)
    # Layers 0, 2 and 3 sliding (2 KV heads of 16), 1 and 4 full (2 KV heads of 32); 3 reads
    # 2's cache, 4 reads 1's: the same tensors.
    assert [tuple(c.shape[3:]) for c in caches] == [(2, 16), (2, 32), (2, 16), (2, 16), (2, 32)]
    assert caches[3] is caches[2] and caches[4] is caches[1]
    assert len({c.data_ptr() for c in caches}) == 3
    per_token = 2 * 4 * (2 * 16 + 2 * 32 + 2 * 16)  # K and V, float32, layers 0-2
    assert model.kv_cache_bytes_per_block(16) == 16 * per_token


@pytest.mark.parametrize(
    ("kind", "layer", "module"),
    [("gemma4_k_eq_v", 1, "self_attn.v_proj"), ("gemma4_text", 3, "self_attn.k_proj")],
)
def test_adapters_of_projections_a_layer_lacks_are_refused(kind, layer, module, tmp_path):
    """A full-attention layer whose values are its keys has no v_proj, a KV-sharing layer no
    k_proj or v_proj: an adapter of one was trained for another model."""
    save_model(kind, tmp_path / "m")
    cfg = read_model_config(tmp_path / "m")
    _adapter(tmp_path / "a", cfg, {layer: (module,)})
    with pytest.raises(ValueError, match=f"adapts a projection layer {layer} does not have"):
        check_adapter(tmp_path / "a", cfg, 8)


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 4's checkpoints are Gemma4ForConditionalGeneration: Weir reads text_config and the
    language_model.* tensors (per-layer embeddings included); a text prompt decodes as
    transformers decodes it with the whole model."""
    torch.manual_seed(0)
    config = transformers.Gemma4Config(text_config=CONFIGS["gemma4_text"]().to_dict())
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    spread_weights_(hf)
    hf.save_pretrained(tmp_path)
    cfg = read_model_config(tmp_path)
    assert cfg.multimodal and cfg.model_type == "gemma4_text" and cfg.per_layer_input_size == 8
    prompts = [list(range(5, 25)), [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": greedy(hf, prompt, 8) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want


def test_dummy_weights_of_a_hub_config_run(tmp_path):
    """A config.json as Google writes it, no weights: ``--load-format dummy`` builds each
    layer of its own shape, its layer scalars at 1 (at random near 0 they would zero the
    residual stream), and a step's logits are finite and differ by token."""
    (tmp_path / "config.json").write_text(json.dumps(HUB_STYLE))
    model = load_model(tmp_path, load_format="dummy")
    assert all(float(layer.layer_scalar.weight) == 1.0 for layer in model.layers)
    ids = list(range(3, 30))
    input_ids, positions, meta = PagedRequests(seed=0).step([("A", ids, 0)])
    with torch.inference_mode():
        kv = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        logits = model.compute_logits(model(input_ids, positions, meta, kv))
    assert logits.isfinite().all() and logits.std(dim=0).mean() > 1e-3
