"""Quantized checkpoints: FP8 ones as DeepSeek and Qwen publish them (blocks of E4M3 weights,
``weight_scale_inv``), read by transformers' own dequantizing loader as the reference, and
llm-compressor's compressed-tensors ones (W4A16 by groups, symmetric and not; W8A16; FP8 by channel and by block; INT8 by channel), written by the
compressed-tensors library and decompressed by it for the reference. Weir, dequantizing as
it loads, decodes as that reference does (through the engine core, chunked and preempted, in
one process and at TP=2); what it does not read is refused by name."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")

import tp_workload  # noqa: E402
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized  # noqa: E402
from lora_adapters import greedy  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402

from weir.services.executor.quantized_checkpoint import DequantizedWeight, unpack_int32  # noqa: E402
from weir.services.executor.weights import load_model  # noqa: E402
from weir.shared.checkpoint_quantization import CheckpointQuantization  # noqa: E402
from weir.shared.model_config import read_model_config  # noqa: E402

VOCAB = 131
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=192,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    # Rows of 48 and 80 columns: packed codes that do not fill their last words.
    "narrow": lambda: transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 48, "head_dim": 12, "intermediate_size": 80}
    ),
    # Every expert's projections quantized, the router not (as Qwen3-30B-A3B-FP8's).
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
    ),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [40, 3, 90, 7]]


def random_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights_(model)
    return model


def decodes_as(path, reference: torch.nn.Module, world_sizes=(1, 2)) -> None:
    work = tp_workload.Workload(str(path), PROMPTS, max_tokens=8, num_blocks=7)
    want = {f"r{i}": greedy(reference, prompt, 8) for i, prompt in enumerate(PROMPTS)}
    if 1 in world_sizes:
        one = tp_workload.run(work)
        assert one.chunked and one.preempted
        assert one.outputs == want
    if 2 in world_sizes:
        for report in tp_workload.run_group(work, world_size=2):
            assert report.outputs == want


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes and the scale of each block (its largest value at E4M3's largest, 448)."""
    rows, columns = weight.shape
    tiles = weight.reshape(rows // block[0], block[0], columns // block[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    codes = (tiles / scale[:, None, :, None]).reshape(rows, columns).to(torch.float8_e4m3fn)
    return codes, scale


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_an_fp8_checkpoint_decodes_as_transformers_dequantizes_it(kind, tmp_path):
    """Qwen3-*-FP8's format: every projection's weight E4M3 with a float32 scale per 32 x 64
    block (128 x 128 in the releases), the embeddings, norms and router unquantized;
    transformers' FineGrainedFP8 loader dequantizes it on a CPU."""
    random_model(kind).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name], tensors[f"{name}_scale_inv"] = fp8_blocks(tensors[name], (32, 64))
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [32, 64],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    reference.eval()
    layer = reference.model.layers[0].self_attn.q_proj
    assert type(layer) is torch.nn.Linear, "transformers must dequantize, not run FP8"
    decodes_as(tmp_path, reference, world_sizes=(1, 2) if kind == "llama" else (1,))


def compressed(model: torch.nn.Module, preset: str, path, **weights) -> torch.nn.Module:
    """``model`` quantized by compressed-tensors' ``preset`` scheme (its weights' arguments
    changed by ``weights``), scales by each block's range, saved compressed to ``path``;
    returns the model of the weights compressed-tensors decompresses them to."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    for key, value in weights.items():
        setattr(scheme.weights, key, value)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for module in model.modules():
            if is_module_quantized(module):
                low, high = _ranges(module)
                scale, zero_point = calculate_qparams(low, high, module.quantization_scheme.weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(
                        zero_point.reshape(module.weight_zero_point.shape)
                    )
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    compressor.decompress_model(model)
    reference = type(model)(model.config).eval()
    parts = ("_scale", "_zero_point", "_shape")
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(parts)}
    reference.load_state_dict(state, strict=True)
    return reference


def _ranges(module) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scale's (min, max) of its weights: per channel, group or block."""
    weight, args = module.weight, module.quantization_scheme.weights
    if args.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == "block":
        rows, columns = args.block_structure
        tiles = weight.reshape(weight.shape[0] // rows, rows, weight.shape[1] // columns, columns)
        return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    groups = weight.reshape(weight.shape[0], -1, args.group_size)
    return groups.amin(2), groups.amax(2)


SCHEMES = {
    "w4a16": ("W4A16", {"group_size": 32}),
    "w4a16-asym": ("W4A16_ASYM", {"group_size": 32}),
    "w8a16": ("W8A16", {"group_size": 32}),
    "fp8-channel": ("FP8_DYNAMIC", {}),
    "fp8-block": ("FP8_BLOCK", {"block_structure": [32, 32]}),
    "int8-channel": ("W8A8", {}),
}


@pytest.mark.parametrize("preset", ["W4A16", "W8A16"])
def test_packed_rows_that_end_inside_a_word_decode_as_the_library_decompresses_them(
    preset, tmp_path
):
    """Rows of 48 and 80 columns packed densely (the last word of a row part empty), with a
    scale per row."""
    weights = {"strategy": "channel", "group_size": None}
    reference = compressed(random_model("narrow"), preset, tmp_path, **weights)
    decodes_as(tmp_path, reference, world_sizes=(1,))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_compressed_tensors_checkpoint_decodes_as_the_library_decompresses_it(scheme, tmp_path):
    preset, weights = SCHEMES[scheme]
    reference = compressed(random_model("llama"), preset, tmp_path, **weights)
    quantization = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors"
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors or tensors[
        "model.layers.0.self_attn.q_proj.weight"
    ].dtype in (torch.float8_e4m3fn, torch.int8)
    decodes_as(tmp_path, reference, world_sizes=(1, 2) if scheme == "w4a16-asym" else (1,))


def test_packed_integers_unpack_as_the_library_packs_them():
    """Every width from 2 to 8 bits, rows not a multiple of 32 long."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    generator = torch.Generator().manual_seed(0)
    for bits in range(2, 9):
        low = -(1 << (bits - 1))
        values = torch.randint(low, -low, (5, 77), generator=generator, dtype=torch.int8)
        packed = pack_to_int32(values, bits)
        assert torch.equal(unpack_int32(packed, bits, 77), values.to(torch.int32)), bits


def test_blocks_that_do_not_divide_the_weight_are_cut_short():
    """A 100 x 70 weight in blocks of 64 x 64: a 2 x 2 grid whose last blocks are short, read
    whole and by any rows and columns (a rank's share)."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randn(100, 70, generator=generator).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=generator) + 0.5
    want = codes.float() * scale.repeat_interleave(64, 0)[:100].repeat_interleave(64, 1)[:, :70]
    blocks = CheckpointQuantization("fp8", (64, 64), ("block",))
    weight = DequantizedWeight("w", _Source(codes), (100, 70), scale, None, blocks)
    assert torch.equal(weight[(slice(None),)], want)
    assert torch.equal(weight[(slice(30, 90), slice(10, 66))], want[30:90, 10:66])
    with pytest.raises(ValueError, match=r"w: scales \(2, 2\) do not cover a \(100, 70\) weight"):
        other = CheckpointQuantization("fp8", (32, 64), ("block",))
        DequantizedWeight("w", _Source(codes), (100, 70), scale, None, other)


class _Source:
    """A tensor in memory as safetensors' slice of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_dtype(self) -> str:
        return {torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32"}[self.tensor.dtype]

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        return self.tensor[index]


@pytest.mark.parametrize(
    ("quantization", "error"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not read"),
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not read"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "block size must be"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4}}},
            },
            "'g' is nvfp4-pack-quantized float 4-bit weights",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}},
                "sparsity_config": {"format": "sparse-24-bitmask"},
            },
            "sparsity_config",
        ),
    ],
)
def test_a_quantization_weir_does_not_read_is_refused_by_its_config(quantization, error, tmp_path):
    random_model("llama").config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization})
    )
    with pytest.raises(ValueError, match=error):
        read_model_config(tmp_path)


def test_a_quantized_weight_weir_cannot_read_is_refused_by_name(tmp_path):
    """A weight without its scale, or whose scales or zero points are not what config.json
    says; codes of a dtype no scheme writes; GPTQ's activation order (group indices, as
    older compressed-tensors versions saved them)."""
    compressed(random_model("llama"), "W4A16_ASYM", tmp_path / "asym", group_size=32)
    compressed(random_model("llama"), "FP8_DYNAMIC", tmp_path / "fp8")
    layer = "model.layers.1.mlp.up_proj"
    cases = [
        ("asym", f"{layer}.weight_scale", None, f"{layer}.weight_packed is quantized"),
        ("asym", f"{layer}.weight_zero_point", None, "asymmetric, but it has no weight_zero_p"),
        ("asym", "model.layers.0.mlp.down_proj.weight_g_idx", torch.arange(192) // 32, "GPTQ's"),
        ("fp8", f"{layer}.weight", lambda t: t.view(torch.uint8), r"U8 \[192, 128\] is not a"),
        ("fp8", f"{layer}.weight_scale", lambda t: t[:96], r"scales \(96, 1\) do not cover"),
        ("fp8", f"{layer}.weight_scale", lambda t: t.reshape(1, 192), r"scales \(1, 192\)"),
        ("fp8", f"{layer}.weight_scale", lambda t: t[:, :, None], "of at most 2 dimensions"),
        ("fp8", f"{layer}.weight_scale", lambda t: t.to(torch.int32), "floating-point"),
    ]
    for model, name, change, error in cases:
        path = tmp_path / model / "model.safetensors"
        tensors = load_file(path)
        original = {**tensors}
        if change is None:
            del tensors[name]
        else:
            tensors[name] = change(tensors[name]) if callable(change) else change
        save_file(tensors, path)
        with pytest.raises(ValueError, match=error):
            load_model(tmp_path / model)
        save_file(original, path)
