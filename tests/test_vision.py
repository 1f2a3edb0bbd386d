"""The vision tower of Idefics3 and SmolVLM (SigLIP-style transformer, pixel shuffle,
modality projection) as transformers computes it: random small models saved by
transformers (their config.json and safetensors, the names it writes), read by
`VisionConfig.from_hf` and `load_vision_weights`, and encoded as ``get_image_features``
encodes the same tiles, in float32 and bfloat16; SmolVLM-256M's shapes on the meta device;
and what Weir refuses of a config or a checkpoint."""

import copy
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import CPU_AND_CUDA  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.idefics3.modeling_idefics3 import (  # noqa: E402
    Idefics3Connector,
    Idefics3VisionEmbeddings,
)

from weir.services.executor.vision import (  # noqa: E402
    VisionTower,
    is_vision_weight,
    load_vision_weights,
    pixel_shuffle,
    position_ids,
)
from weir.services.executor.weights import iter_safetensors  # noqa: E402
from weir.shared.vision_config import GELU_APPROXIMATION, VisionConfig  # noqa: E402

MODEL_TYPES = ("idefics3", "smolvlm")
HF_CLASSES = {
    "idefics3": (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration),
    "smolvlm": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration),
}
# 8 x 8 patches a tile, folded 2 x 2: 16 tokens of the text model's 48.
VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=64,
    patch_size=8,
)
TEXT = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# SmolVLM-256M-Instruct's config.json, the keys that shape its vision tower.
SMOLVLM_256M = {
    "model_type": "smolvlm",
    "scale_factor": 4,
    "vision_config": {
        "model_type": "smolvlm_vision",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 512,
        "patch_size": 16,
    },
    "text_config": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49280,
    },
}


@torch.no_grad()
def _randomize_(model: torch.nn.Module) -> None:
    """Every weight random, the norms' too (transformers initialises them at 1 and 0, which
    would hide a norm's weight or bias read from the wrong place)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.1 * torch.randn_like(p))


def _saved_model(tmp_path_factory, model_type, vision=VISION, scale_factor=2):
    """A random transformers model (float32, eval), saved: (model, its directory)."""
    config_class, model_class = HF_CLASSES[model_type]
    config = config_class(vision_config=vision, text_config=TEXT, scale_factor=scale_factor)
    torch.manual_seed(0)
    model = model_class(config).eval()
    _randomize_(model)
    path = tmp_path_factory.mktemp(model_type)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=MODEL_TYPES)
def saved(request, tmp_path_factory):
    return _saved_model(tmp_path_factory, request.param)


def _tower(path, dtype=torch.float32, device="cpu") -> VisionTower:
    config = VisionConfig.from_hf(json.loads((path / "config.json").read_text()))
    tower = VisionTower(config, dtype, device)
    load_vision_weights(tower, iter_safetensors(path))  # safetensors slices, as served
    return tower


def _pixels(tiles: int, size: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(tiles, 3, size, size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(model, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' image features of one image of these tiles: [tiles, tokens, hidden]."""
    features = model.model.get_image_features(pixels[None]).pooler_output
    assert len(features) == 1
    return features[0].reshape(pixels.shape[0], -1, features[0].shape[-1])


@pytest.mark.parametrize("tiles", [1, 5])
def test_matches_transformers(saved, tiles):
    model, path = saved
    tower = _tower(path)
    assert tower.config.tokens_per_tile == model.model.image_seq_len == 16
    pixels = _pixels(tiles)
    with torch.no_grad():
        out = tower(pixels)
    expected = _reference(model, pixels)
    assert out.shape == (tiles, 16, 48) == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # transformers' eager attention too (its own softmax, not torch's SDPA).
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert eager.model.vision_model.config._attn_implementation == "eager"
    torch.testing.assert_close(out, _reference(eager, pixels), rtol=1e-5, atol=1e-5)
    # Each tile on its own: no tile sees another's patches.
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels[-1:]), out[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_bfloat16_within_transformers_own_rounding(saved, device):
    """bfloat16 as close to the float32 reference as transformers' own bfloat16 is (on the
    CPU, whichever device Weir runs on)."""
    model, path = saved
    pixels = _pixels(5)
    expected = _reference(model, pixels)
    hf_error = (_reference(copy.deepcopy(model).bfloat16(), pixels).float() - expected).abs()
    tower = _tower(path, torch.bfloat16, device)
    with torch.no_grad():
        out = tower(pixels.to(device))
    assert out.dtype == torch.bfloat16
    error = (out.float().cpu() - expected).abs()
    assert error.max() <= 1.5 * hf_error.max()
    assert error.mean() <= 1.5 * hf_error.mean()


def test_checkpoint_names(saved):
    """transformers 5 saves the tower under model.vision_model. and the connector under
    model.connector.; the base model alone (its AutoModel) saves them without model., which
    loads too. Every other tensor (the language model's, the head) is left alone."""
    model, path = saved
    names = list(load_file(path / "model.safetensors"))
    vision = [n for n in names if is_vision_weight(n)]
    assert "model.connector.modality_projection.proj.weight" in vision
    assert "model.vision_model.encoder.layers.1.self_attn.q_proj.bias" in vision
    assert all(n.startswith(("model.vision_model.", "model.connector.")) for n in vision)
    assert len(vision) == 5 + 16 * 2 + 1
    assert "model.text_model.layers.0.self_attn.q_proj.weight" in names  # and ignored
    tensors = load_file(path / "model.safetensors")
    tower = _tower(path)
    bare = VisionTower(tower.config, torch.float32, "cpu")
    load_vision_weights(bare, ((n.removeprefix("model."), t) for n, t in tensors.items()))
    pixels = _pixels(2)
    with torch.no_grad():
        torch.testing.assert_close(bare(pixels), tower(pixels), rtol=0, atol=0)


def test_odd_grid_and_scale(tmp_path_factory):
    """25 x 25 patches folded 5 x 5: a grid whose position ids transformers' float32
    bucketing does not number in order, and a scale factor other than 2."""
    assert not torch.equal(position_ids(25), torch.arange(625))
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=50,
        patch_size=2,
    )
    model, path = _saved_model(tmp_path_factory, "smolvlm", vision, scale_factor=5)
    tower = _tower(path)
    assert tower.config.tokens_per_tile == 25
    pixels = _pixels(2, size=50)
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels), _reference(model, pixels), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_position_ids_as_transformers_numbers_them():
    """A full tile's position ids, every grid of 1 to 99 patches a side, read back from
    transformers' embeddings (each position's row holding its own index)."""
    for side in range(1, 100):
        config = transformers.Idefics3VisionConfig(
            hidden_size=1, num_attention_heads=1, image_size=side, patch_size=1
        )
        embeddings = Idefics3VisionEmbeddings(config)
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(side * side)[:, None])
        mask = torch.ones(1, side, side, dtype=torch.bool)
        ids = embeddings(torch.zeros(1, 3, side, side), mask)[0, :, 0].long()
        assert torch.equal(position_ids(side), ids), side


@pytest.mark.parametrize("scale", [1, 2, 3, 4])
def test_pixel_shuffle_is_transformers(scale):
    side = 12
    x = torch.randn(3, side * side, 5)
    connector = Idefics3Connector.__new__(Idefics3Connector)
    expected = connector.pixel_shuffle(x, scale)
    assert torch.equal(pixel_shuffle(x, side, scale), expected)


def test_gelus_are_transformers():
    x = torch.linspace(-8, 8, 1001)
    for name, approximate in GELU_APPROXIMATION.items():
        torch.testing.assert_close(
            torch.nn.functional.gelu(x, approximate=approximate),
            ACT2FN[name](x),
            rtol=1e-6,
            atol=1e-6,
            msg=name,
        )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_defaults_are_transformers(model_type):
    """Every key left out is transformers' default, which, whole, is no model: its 224-pixel
    tiles of 32-pixel patches, 7 a side, cannot be folded 2 x 2 (its own pixel shuffle fails
    on them); a scale_factor of 7 folds them."""
    hf = HF_CLASSES[model_type][0]()
    with pytest.raises(ValueError, match=r"scale_factor 2 does not divide the 7 patches"):
        VisionConfig.from_hf({"model_type": model_type})
    assert hf.scale_factor == 2
    config = VisionConfig.from_hf({"model_type": model_type, "scale_factor": 7})
    vision_fields = [f.name for f in dataclasses.fields(config)][:-2]
    for field in vision_fields:
        assert getattr(config, field) == getattr(hf.vision_config, field), field
    assert config.text_hidden_size == hf.text_config.hidden_size
    # A text_config of no model_type is transformers' Llama, of its default size where left out.
    given = {"model_type": model_type, "scale_factor": 7, "text_config": {}, "vision_config": {}}
    assert VisionConfig.from_hf(given) == config


@torch.no_grad()
def test_smolvlm_256m_shapes_on_meta():
    """SmolVLM-256M's tower built, loaded and run on the meta device: transformers' tensors
    of it, by name and shape; 93M parameters; 64 tokens of 576 a 512-pixel tile."""
    config = VisionConfig.from_hf(SMOLVLM_256M)
    assert config.tokens_per_tile == 64
    hf_config = transformers.SmolVLMConfig(
        vision_config=SMOLVLM_256M["vision_config"],
        text_config={**SMOLVLM_256M["text_config"], "num_hidden_layers": 1},
        scale_factor=4,
    )
    with torch.device("meta"):
        hf = transformers.SmolVLMForConditionalGeneration(hf_config)
    assert hf.model.image_seq_len == 64
    tower = VisionTower(config, torch.bfloat16, "meta")
    state = hf.state_dict()
    load_vision_weights(tower, state.items())
    parameters = sum(p.numel() for p in tower.parameters())
    assert parameters == sum(t.numel() for n, t in state.items() if is_vision_weight(n))
    assert parameters == 93_510_912
    assert tower(torch.empty(2, 3, 512, 512, device="meta")).shape == (2, 64, 576)


def _config(**changes):
    hf = {"model_type": "idefics3", "text_config": TEXT, "vision_config": dict(VISION)}
    hf["vision_config"].update({k: v for k, v in changes.items() if k != "scale_factor"})
    if "scale_factor" in changes:
        hf["scale_factor"] = changes["scale_factor"]
    return hf


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_act": "quick_gelu"}, r"vision_config\.hidden_act 'quick_gelu' is not supported"),
        ({"hidden_act": "silu"}, r"vision_config\.hidden_act 'silu' is not supported"),
        ({"hidden_act": 1}, r"vision_config\.hidden_act must be a string"),
        ({"image_size": 60}, r"image_size 60 is not a multiple of vision_config\.patch_size 8"),
        ({"scale_factor": 3}, r"scale_factor 3 does not divide the 8 patches per side"),
        ({"image_size": [64, 64]}, r"vision_config\.image_size must be a positive integer"),
        ({"hidden_size": "64"}, r"vision_config\.hidden_size must be a positive integer"),
        ({"num_attention_heads": 5}, r"hidden_size 64 is not a multiple of .*heads 5"),
        ({"layer_norm_eps": -1.0}, r"vision_config\.layer_norm_eps must be a positive number"),
        ({"scale_factor": 0}, r"scale_factor must be a positive integer"),
    ],
)
def test_config_refusals(changes, message):
    VisionConfig.from_hf(_config())
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf(_config(**changes))


def test_config_refusals_of_the_whole_file():
    with pytest.raises(ValueError, match=r"model_type 'llava' has no vision tower"):
        VisionConfig.from_hf({**_config(), "model_type": "llava"})
    with pytest.raises(ValueError, match=r"has no 'text_config\.hidden_size'"):
        VisionConfig.from_hf({**_config(), "text_config": {"model_type": "qwen2"}})
    with pytest.raises(ValueError, match=r"vision_config must be an object"):
        VisionConfig.from_hf({**_config(), "vision_config": [1]})


@pytest.fixture(scope="module")
def idefics3_tensors(tmp_path_factory):
    model, path = _saved_model(tmp_path_factory, "idefics3")
    config = VisionConfig.from_hf(json.loads((path / "config.json").read_text()))
    return config, load_file(path / "model.safetensors")


def _refused(config, tensors, message):
    tower = VisionTower(config, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        load_vision_weights(tower, tensors.items())


def test_missing_tensor_refused(idefics3_tensors):
    config, tensors = idefics3_tensors
    name = "model.vision_model.encoder.layers.1.self_attn.k_proj.bias"
    _refused(
        config,
        {n: t for n, t in tensors.items() if n != name},
        rf"lacks 1 of the vision tower's tensors: {name}",
    )
    no_connector = {n: t for n, t in tensors.items() if "connector" not in n}
    _refused(config, no_connector, r"model\.connector\.modality_projection\.proj\.weight")


def test_unexpected_tensor_refused(idefics3_tensors):
    config, tensors = idefics3_tensors
    layer = "model.vision_model.encoder.layers.2.mlp.fc1.weight"
    extra = {**tensors, layer: tensors["model.vision_model.encoder.layers.1.mlp.fc1.weight"]}
    _refused(config, extra, rf"{layer}' is no part of .*num_hidden_layers is 2")
    ids = "model.vision_model.embeddings.position_ids"
    _refused(config, {**tensors, ids: torch.arange(64)}, rf"{ids}' is no part of the vision")


def test_wrong_shape_refused(idefics3_tensors):
    config, tensors = idefics3_tensors
    name = "model.connector.modality_projection.proj.weight"
    wrong = {**tensors, name: tensors[name].t()}
    _refused(config, wrong, rf"{name}: checkpoint shape \(256, 48\) != \(48, 256\)")


def test_duplicate_tensor_refused(idefics3_tensors):
    config, tensors = idefics3_tensors
    name = "model.vision_model.post_layernorm.bias"
    twice = {**tensors, name.removeprefix("model."): tensors[name]}
    _refused(config, twice, r"post_layernorm\.bias' and .*hold the same weights")


def test_wrong_pixels_refused(idefics3_tensors):
    config, _ = idefics3_tensors
    tower = VisionTower(config, torch.float32, "meta")
    for shape in [(1, 3, 32, 32), (1, 1, 64, 64), (3, 64, 64)]:
        with pytest.raises(ValueError, match=r"pixel_values must be \[tiles, 3, 64, 64\]"):
            tower(torch.empty(shape, device="meta"))
