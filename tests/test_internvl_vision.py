"""The vision tower of InternVL (InternViT, pixel shuffle, multi-modal projector) as
transformers computes it: random small models saved by transformers (their config.json and
safetensors, the names it writes), read by `InternVLVisionConfig.from_hf` and
`load_internvl_vision_weights`, and encoded as ``get_image_features`` encodes the same
tiles, in float32 and bfloat16, with either norm, with and without q/k norms, from each
hidden state ``vision_feature_layer`` may select; InternVL3-1B-hf's shapes on the meta
device; and what Weir refuses of a config or a checkpoint."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import CPU_AND_CUDA  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers.models.internvl.modeling_internvl import (  # noqa: E402
    InternVLModel,
    InternVLVisionEmbeddings,
)

from weir.services.executor.internvl_vision import (  # noqa: E402
    InternVLVisionTower,
    is_internvl_vision_weight,
    load_internvl_vision_weights,
)
from weir.services.executor.vision import pixel_shuffle  # noqa: E402
from weir.services.executor.weights import iter_safetensors  # noqa: E402
from weir.shared.internvl_vision_config import InternVLVisionConfig  # noqa: E402

# 8 x 8 patches a tile (and the CLS token), folded 2 x 2: 16 tokens of the text model's 48.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=4,
)
# InternViT-300M's kind (InternVL3-1B to 14B): LayerNorms, q/k/v biases, no final norm; and
# InternViT-6B's (RMS norms, q/k norms, no q/k/v biases), here with a final norm, a mask
# token and tanh GELUs too, and an eps the q/k norms' (1e-6) and the projector's (1e-5) are
# not.
VARIANTS = {
    "layer_norm": dict(norm_type="layer_norm", attention_bias=True),
    "rms_qk_norm": dict(
        norm_type="rms_norm",
        layer_norm_eps=1e-3,
        use_qk_norm=True,
        attention_bias=False,
        use_mean_pooling=False,
        use_mask_token=True,
        hidden_act="gelu_pytorch_tanh",
    ),
}
TEXT = dict(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# InternVL3-1B-hf's config.json, the keys that shape its vision tower and projector (from
# memory: InternViT-300M-448px-V2_5 and Qwen2.5-0.5B's width).
INTERNVL3_1B = {
    "model_type": "internvl",
    "downsample_ratio": 0.5,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "image_seq_length": 256,
    "vision_config": {
        "model_type": "internvl_vision",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": [448, 448],
        "patch_size": [14, 14],
        "attention_bias": True,
        "use_qk_norm": False,
        "norm_type": "layer_norm",
        "layer_norm_eps": 1e-6,
        "layer_scale_init_value": 0.1,
        "hidden_act": "gelu",
        "use_mean_pooling": True,
        "use_absolute_position_embeddings": True,
    },
    "text_config": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151674,
    },
}


@torch.no_grad()
def _randomize_(model: torch.nn.Module) -> None:
    """Every weight random: the norms' (transformers initialises them at 1 and 0), the
    layer scales' (at layer_scale_init_value), the CLS token's and position embeddings'
    (at 0) too, which would hide one read from the wrong place or not at all."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
        elif "lambda" in name:
            p.copy_(0.5 + 0.3 * torch.randn_like(p))
        else:
            p.copy_(0.1 * torch.randn_like(p))


def _saved_model(tmp_path_factory, vision_changes=None, **top):
    """A random transformers model (float32, eval), saved: (model, its directory)."""
    config = transformers.InternVLConfig(
        vision_config={**VISION, **(vision_changes or {})}, text_config=TEXT, **top
    )
    torch.manual_seed(0)
    model = transformers.InternVLForConditionalGeneration(config).eval()
    _randomize_(model)
    path = tmp_path_factory.mktemp("internvl")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    return _saved_model(tmp_path_factory, VARIANTS[request.param])


def _hf_config(path, **changes):
    return {**json.loads((path / "config.json").read_text()), **changes}


def _tower(path, dtype=torch.float32, device="cpu", **changes) -> InternVLVisionTower:
    config = InternVLVisionConfig.from_hf(_hf_config(path, **changes))
    tower = InternVLVisionTower(config, dtype, device)
    load_internvl_vision_weights(tower, iter_safetensors(path))  # safetensors slices, as served
    return tower


def _pixels(tiles: int, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(tiles, 3, size, size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(model, pixels: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """transformers' image features of these tiles: [tiles, tokens, hidden]. (Of layer 0,
    the embeddings, only with every hidden state asked for: get_image_features asks the
    vision model for the one it selects by passing its index as output_hidden_states, and
    0 is false, so none is kept.)"""
    return model.model.get_image_features(
        pixels,
        vision_feature_layer=layer,
        vision_feature_select_strategy="default",
        **({"output_hidden_states": True} if layer == 0 else {}),
    ).pooler_output


@pytest.mark.parametrize("tiles", [1, 3])
def test_matches_transformers(saved, tiles):
    model, path = saved
    tower = _tower(path)
    assert tower.config.tokens_per_tile == 16
    pixels = _pixels(tiles)
    with torch.no_grad():
        out = tower(pixels)
    expected = _reference(model, pixels)
    assert out.shape == (tiles, 16, 48) == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # transformers' eager attention too (its own softmax, not torch's SDPA).
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert eager.model.vision_tower.config._attn_implementation == "eager"
    torch.testing.assert_close(out, _reference(eager, pixels), rtol=1e-5, atol=1e-5)
    # Each tile on its own: no tile sees another's patches.
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels[-1:]), out[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_bfloat16_within_transformers_own_rounding(saved, device):
    """bfloat16 as close to the float32 reference as transformers' own bfloat16 is (on the
    CPU, whichever device Weir runs on)."""
    model, path = saved
    pixels = _pixels(3)
    expected = _reference(model, pixels)
    hf_error = (_reference(copy.deepcopy(model).bfloat16(), pixels).float() - expected).abs()
    tower = _tower(path, torch.bfloat16, device)
    with torch.no_grad():
        out = tower(pixels.to(device))
    assert out.dtype == torch.bfloat16
    error = (out.float().cpu() - expected).abs()
    assert error.max() <= 1.5 * hf_error.max()
    assert error.mean() <= 1.5 * hf_error.mean()


@pytest.fixture(scope="module")
def final_norm_model(tmp_path_factory):
    return _saved_model(tmp_path_factory, VARIANTS["rms_qk_norm"])


@pytest.mark.parametrize("layer, layers_run", [(-1, 2), (-2, 1), (-3, 0), (0, 0), (1, 1), (2, 2)])
def test_vision_feature_layer(final_norm_model, layer, layers_run):
    """Each hidden state vision_feature_layer selects: -1 the vision model's output, through
    its final norm; another transformers' hidden_states[layer] (the embeddings' first), not
    normed, so layer 2 of 2 differs from -1. Only the layers it needs are built and run; the
    later ones' tensors (and an unread final norm's) are checked and skipped."""
    model, path = final_norm_model
    tower = _tower(path, vision_feature_layer=layer)
    assert len(tower.layers) == layers_run
    assert (tower.final_norm is not None) == (layer == -1)
    pixels = _pixels(2)
    with torch.no_grad():
        out = tower(pixels)
    torch.testing.assert_close(out, _reference(model, pixels, layer), rtol=1e-5, atol=1e-5)
    if layer == 2:
        assert not torch.allclose(out, _reference(model, pixels, -1), rtol=1e-3, atol=1e-3)


def test_quarter_downsample_without_position_embeddings(tmp_path_factory):
    """downsample_ratio 0.25 (4 x 4 patches a token) and a tower of no absolute position
    embeddings (transformers' use_absolute_position_embeddings false)."""
    model, path = _saved_model(
        tmp_path_factory, {"use_absolute_position_embeddings": False}, downsample_ratio=0.25
    )
    assert not any("position_embeddings" in n for n in load_file(path / "model.safetensors"))
    tower = _tower(path)
    assert tower.config.tokens_per_tile == 4
    assert tower.position_embedding is None
    pixels = _pixels(2)
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels), _reference(model, pixels), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side, ratio", [(8, 0.5), (12, 0.5), (8, 0.25), (8, 0.125), (4, 1.0)])
def test_pixel_shuffle_is_transformers(side, ratio):
    """InternVL's pixel shuffle (its features as [tiles, side, side, hidden]) is Idefics3's
    order: each block's patches row by row of the block, the blocks row-major."""
    scale = round(1 / ratio)
    x = torch.randn(3, side * side, 5)
    expected = InternVLModel.pixel_shuffle(None, x.reshape(3, side, side, 5), ratio)
    assert torch.equal(pixel_shuffle(x, side, scale), expected.reshape(3, -1, 5 * scale**2))


def test_position_embeddings_not_interpolated():
    """At image_size, transformers adds its position embeddings as they are (at another size
    it interpolates them, which Weir's tiles never need)."""
    config = transformers.InternVLVisionConfig(**VISION)
    embeddings = InternVLVisionEmbeddings(config)
    at_size = torch.empty(1, 65, 32)
    assert embeddings.interpolate_pos_encoding(at_size, 32, 32) is embeddings.position_embeddings
    other = embeddings.interpolate_pos_encoding(torch.empty(1, 17, 32), 16, 16)
    assert other.shape == (1, 17, 32)


def test_checkpoint_names(saved):
    """transformers 5's save_pretrained writes the tower under vision_tower. and the
    projector under multi_modal_projector. (the Hub's 4.x layout: the language model under
    language_model.model., the head language_model.lm_head.), though its modules name them
    under model. (the state_dict's names), which load too. Every other tensor is left
    alone."""
    model, path = saved
    tensors = load_file(path / "model.safetensors")
    vision = {n for n in tensors if is_internvl_vision_weight(n)}
    assert "multi_modal_projector.linear_1.weight" in vision
    assert "vision_tower.encoder.layer.1.lambda_2" in vision
    assert "vision_tower.embeddings.cls_token" in vision
    assert all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in vision)
    state = model.state_dict()
    assert {f"model.{n}" for n in vision} == {n for n in state if is_internvl_vision_weight(n)}
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in tensors  # and ignored
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in state  # and ignored
    tower = _tower(path)
    named_as_modules = InternVLVisionTower(tower.config, torch.float32, "cpu")
    load_internvl_vision_weights(named_as_modules, state.items())
    pixels = _pixels(2)
    with torch.no_grad():
        torch.testing.assert_close(named_as_modules(pixels), tower(pixels), rtol=0, atol=0)


def test_full_strategy_refused_as_transformers_fails(saved):
    """vision_feature_select_strategy "full" (the CLS token kept) leaves no square grid to
    fold: transformers' get_image_features fails on it, and Weir refuses it by name."""
    model, path = saved
    with pytest.raises(RuntimeError):
        model.model.get_image_features(_pixels(1), vision_feature_select_strategy="full")
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy 'full' is not supp"):
        InternVLVisionConfig.from_hf(_hf_config(path, vision_feature_select_strategy="full"))


def test_defaults_are_transformers():
    """Every key left out is transformers' default (InternVLConfig's, its Qwen2 text_config's
    hidden size), a text_config of Qwen3 or Llama of its type's default width."""
    hf = transformers.InternVLConfig()
    config = InternVLVisionConfig.from_hf({"model_type": "internvl"})
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_channels",
        "hidden_act",
        "norm_type",
        "layer_norm_eps",
        "use_qk_norm",
        "attention_bias",
        "layer_scale_init_value",
        "use_mean_pooling",
        "use_absolute_position_embeddings",
        "use_mask_token",
    ):
        assert getattr(config, field) == getattr(hf.vision_config, field), field
    assert (config.image_size,) * 2 == tuple(hf.vision_config.image_size)
    assert (config.patch_size,) * 2 == tuple(hf.vision_config.patch_size)
    for field in (
        "downsample_ratio",
        "projector_hidden_act",
        "vision_feature_layer",
        "vision_feature_select_strategy",
    ):
        assert getattr(config, field) == getattr(hf, field), field
    assert config.text_hidden_size == hf.text_config.hidden_size
    assert config.tokens_per_tile == hf.image_seq_length == 256
    given = {"model_type": "internvl", "text_config": {}, "vision_config": {}}
    assert InternVLVisionConfig.from_hf(given) == config
    nulls = {"model_type": "internvl", "downsample_ratio": None, "vision_feature_layer": None}
    assert InternVLVisionConfig.from_hf(nulls) == config
    for text_type, text_class in [
        ("qwen3", transformers.Qwen3Config),
        ("llama", transformers.LlamaConfig),
    ]:
        typed = {"model_type": "internvl", "text_config": {"model_type": text_type}}
        assert InternVLVisionConfig.from_hf(typed).text_hidden_size == text_class().hidden_size


@torch.no_grad()
@pytest.mark.parametrize("text_hidden", [896, 3584])  # InternVL3-1B's; 8B's (Qwen2.5-7B's)
def test_internvl3_shapes_on_meta(text_hidden):
    """InternVL3-1B-hf's tower (and 8B's, the same InternViT-300M to a wider language model)
    built, loaded and run on the meta device: transformers' tensors of it, by name and
    shape; every one's parameters; 256 tokens a 448-pixel tile."""
    hf_dict = copy.deepcopy(INTERNVL3_1B)
    hf_dict["text_config"]["hidden_size"] = text_hidden
    config = InternVLVisionConfig.from_hf(hf_dict)
    assert config.tokens_per_tile == 256 == hf_dict["image_seq_length"]
    assert config.image_size == 448 and config.patch_size == 14
    hf_config = transformers.InternVLConfig(
        **{k: v for k, v in hf_dict.items() if k not in ("model_type", "text_config")},
        text_config={**hf_dict["text_config"], "num_hidden_layers": 1},
    )
    with torch.device("meta"):
        hf = transformers.InternVLForConditionalGeneration(hf_config)
    tower = InternVLVisionTower(config, torch.bfloat16, "meta")
    state = hf.state_dict()
    load_internvl_vision_weights(tower, state.items())
    parameters = sum(p.numel() for p in tower.parameters())
    assert parameters == sum(t.numel() for n, t in state.items() if is_internvl_vision_weight(n))
    vit = 304_012_288  # InternViT-300M: 0.3B
    projector = 4096 * 2 + 4096 * text_hidden + text_hidden + text_hidden**2 + text_hidden
    assert parameters == vit + projector
    assert tower(torch.empty(2, 3, 448, 448, device="meta")).shape == (2, 256, text_hidden)


def _config(**changes):
    hf = {"model_type": "internvl", "text_config": TEXT, "vision_config": dict(VISION)}
    top = ("downsample_ratio", "projector_hidden_act", "vision_feature_layer")
    top += ("vision_feature_select_strategy",)
    hf["vision_config"].update({k: v for k, v in changes.items() if k not in top})
    hf.update({k: v for k, v in changes.items() if k in top})
    return hf


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_act": "quick_gelu"}, r"vision_config\.hidden_act 'quick_gelu' is not supp"),
        ({"hidden_act": 1}, r"vision_config\.hidden_act must be a string"),
        ({"projector_hidden_act": "silu"}, r"projector_hidden_act 'silu' is not supported"),
        ({"norm_type": "batch_norm"}, r"vision_config\.norm_type 'batch_norm' is not supp"),
        ({"vision_feature_select_strategy": "cls"}, r"strategy 'cls' is not supported"),
        ({"vision_feature_layer": [-1, -2]}, r"vision_feature_layer must be one layer's index"),
        ({"vision_feature_layer": True}, r"vision_feature_layer must be one layer's index"),
        ({"vision_feature_layer": 3}, r"vision_feature_layer 3 selects none of the 3 hidden"),
        ({"vision_feature_layer": -4}, r"vision_feature_layer -4 selects none"),
        ({"downsample_ratio": 0.3}, r"downsample_ratio 0\.3 is not 1 / 2\^k"),
        ({"downsample_ratio": 1 / 3}, r"downsample_ratio 0\.333.* is not 1 / 2\^k"),
        ({"downsample_ratio": 2}, r"downsample_ratio 2\.0 is not 1 / 2\^k"),
        ({"downsample_ratio": 0}, r"downsample_ratio must be a positive number"),
        ({"downsample_ratio": 0.0625}, r"downsample_ratio 0\.0625 cannot fold the 8 patches"),
        ({"image_size": [32, 48]}, r"vision_config\.image_size \[32, 48\] is not a square"),
        ({"patch_size": [4]}, r"vision_config\.patch_size \[4\] is not a square"),
        ({"image_size": "32"}, r"vision_config\.image_size must be a positive integer"),
        ({"image_size": 30}, r"image_size 30 is not a multiple of vision_config\.patch_size 4"),
        ({"num_attention_heads": 5}, r"hidden_size 32 is not a multiple of .*heads 5"),
        ({"use_qk_norm": 1}, r"vision_config\.use_qk_norm must be true or false"),
        ({"attention_bias": "yes"}, r"vision_config\.attention_bias must be true or false"),
        ({"use_mean_pooling": None, "use_mask_token": 0}, r"use_mask_token must be true or"),
        ({"layer_norm_eps": 0}, r"vision_config\.layer_norm_eps must be a positive number"),
        ({"layer_scale_init_value": "0.1"}, r"layer_scale_init_value must be a number"),
    ],
)
def test_config_refusals(changes, message):
    InternVLVisionConfig.from_hf(_config())
    with pytest.raises(ValueError, match=message):
        InternVLVisionConfig.from_hf(_config(**changes))


def test_config_refusals_of_the_whole_file():
    with pytest.raises(ValueError, match=r"model_type 'idefics3' is not 'internvl'"):
        InternVLVisionConfig.from_hf({**_config(), "model_type": "idefics3"})
    with pytest.raises(ValueError, match=r"has no 'text_config\.hidden_size'"):
        InternVLVisionConfig.from_hf({**_config(), "text_config": {"model_type": "gpt_oss"}})
    with pytest.raises(ValueError, match=r"vision_config must be an object"):
        InternVLVisionConfig.from_hf({**_config(), "vision_config": [1]})
    with pytest.raises(ValueError, match=r"must hold a JSON object"):
        InternVLVisionConfig.from_hf([])


@pytest.fixture(scope="module")
def rms_tensors(final_norm_model):
    _, path = final_norm_model
    config = InternVLVisionConfig.from_hf(_hf_config(path))
    return config, load_file(path / "model.safetensors")


def _refused(config, tensors, message):
    tower = InternVLVisionTower(config, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        load_internvl_vision_weights(tower, tensors.items())


def test_missing_tensor_refused(rms_tensors):
    config, tensors = rms_tensors
    for name in [
        "vision_tower.encoder.layer.1.attention.k_norm.weight",
        "vision_tower.encoder.layer.0.lambda_1",
        "vision_tower.layernorm.bias",
        "vision_tower.embeddings.mask_token",
        "multi_modal_projector.layer_norm.weight",
    ]:
        missing = {n: t for n, t in tensors.items() if n != name}
        _refused(config, missing, rf"lacks 1 of the vision tower's tensors: {name}")


def test_unexpected_tensor_refused(rms_tensors):
    config, tensors = rms_tensors
    layer = "vision_tower.encoder.layer.2.lambda_1"
    extra = {**tensors, layer: tensors["vision_tower.encoder.layer.1.lambda_1"]}
    _refused(config, extra, rf"{layer}' is no part of .*num_hidden_layers is 2")
    # q/k/v biases where config.json says attention_bias is false.
    bias = "model.vision_tower.encoder.layer.0.attention.q_proj.bias"
    _refused(config, {**tensors, bias: torch.zeros(32)}, rf"{bias}' is no part of the vision")
    # A LayerNorm's bias where config.json says rms_norm.
    norm = "vision_tower.encoder.layer.0.layernorm_before.bias"
    _refused(config, {**tensors, norm: torch.zeros(32)}, rf"'{norm}' is no part of the vision")


def test_wrong_shape_refused(rms_tensors):
    config, tensors = rms_tensors
    name = "multi_modal_projector.linear_1.weight"
    wrong = {**tensors, name: tensors[name].t()}
    _refused(config, wrong, rf"{name}: checkpoint shape \(128, 48\) != \(48, 128\)")
    cls = "vision_tower.embeddings.cls_token"
    _refused(config, {**tensors, cls: torch.zeros(32)}, rf"{cls}: checkpoint shape \(32,\)")


def test_duplicate_tensor_refused(rms_tensors):
    config, tensors = rms_tensors
    name = "vision_tower.encoder.layer.0.attention.q_norm.weight"
    twice = {**tensors, f"model.{name}": tensors[name]}
    _refused(config, twice, r"q_norm\.weight' and .*hold the same weights")


def test_wrong_pixels_refused(rms_tensors):
    config, _ = rms_tensors
    tower = InternVLVisionTower(config, torch.float32, "meta")
    for shape in [(1, 3, 16, 16), (1, 1, 32, 32), (3, 32, 32)]:
        with pytest.raises(ValueError, match=r"pixel_values must be \[tiles, 3, 32, 32\]"):
            tower(torch.empty(shape, device="meta"))
