"""Quantized checkpoints: FP8 ones as DeepSeek and Qwen publish them (blocks of E4M3 weights,
``weight_scale_inv``), read by transformers' own dequantizing loader as the reference;
llm-compressor's compressed-tensors ones (W4A16 by groups, symmetric and not; W8A16; FP8 by
channel and by block; INT8 by channel), written by the compressed-tensors library and
decompressed by it for the reference; AutoAWQ's, which the library converts to its own
format for the reference; GPTQ's, packed by the library's packer in GPTQ's layout, the
reference weights each code less its group's zero point times its scale. Weir, dequantizing
as it loads, decodes as that reference does (through the engine core, chunked and
preempted, in one process and at TP=2); what it does not read is refused by name."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")

import tp_workload  # noqa: E402
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.entrypoints.convert import AutoAWQConverter, convert_checkpoint  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.utils import (  # noqa: E402
    calculate_qparams,
    generate_gparam,
    is_module_quantized,
)
from lora_adapters import greedy  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402

from weir.services.executor.dequantized_weight import (  # noqa: E402
    DenseCodes,
    DequantizedWeight,
    unpack_int32,
)
from weir.services.executor.gptq_checkpoint import packed_linear_weight  # noqa: E402
from weir.services.executor.model_runner import ModelRunner  # noqa: E402
from weir.services.executor.quantized_checkpoint import dequantized_tensors  # noqa: E402
from weir.services.executor.weights import load_model, open_checkpoint  # noqa: E402
from weir.shared.checkpoint_quantization import (  # noqa: E402
    CheckpointQuantization,
    read_checkpoint_quantization,
)
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


def dequantizes_as(path, weights: dict[str, torch.Tensor], dtype=torch.float32) -> None:
    """The quantized weights of the checkpoint at ``path`` as Weir dequantizes them (in
    float32), rounded to ``dtype``, are ``weights`` (greedy outputs alone miss small uniform
    errors)."""
    quantization = read_model_config(path).checkpoint_quantization
    read = {
        name: tensor[(slice(None),)]
        for name, tensor in dequantized_tensors(open_checkpoint(path), quantization)
        if isinstance(tensor, DequantizedWeight)
    }
    assert read.keys() == weights.keys()
    for name, tensor in read.items():
        torch.testing.assert_close(tensor.to(dtype).float(), weights[name], msg=name)


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
                global_scale = None
                if hasattr(module, "weight_global_scale"):  # NVFP4's: FP8 scales in range
                    global_scale = generate_gparam(module.weight.min(), module.weight.max())
                    module.weight_global_scale.copy_(global_scale.reshape(1))
                args = module.quantization_scheme.weights
                scale, zero_point = calculate_qparams(low, high, args, global_scale)
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
    """Each scale's (min, max) of its weights: per tensor, channel, group or block."""
    weight, args = module.weight, module.quantization_scheme.weights
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
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
    "nvfp4": ("NVFP4A16", {}),
    "mxfp4": ("MXFP4A16", {}),
}


# The weights' arguments of a scheme, where the test computes with them itself.
SCHEMES_ARGS = {"nvfp4": lambda: preset_name_to_scheme("NVFP4A16", ["Linear"]).weights}


def _nvfp4_weights(tensors: dict, args) -> dict[str, torch.Tensor]:
    """Each NVFP4 projection as the library's own unpacking and dequantization compute it,
    in float32."""
    weights = {}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        packed = tensors[name]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, torch.float32)
        weights[f"{module}.weight"] = dequantize(
            codes,
            tensors[f"{module}.weight_scale"].float(),
            args=args,
            dtype=torch.float32,
            global_scale=tensors[f"{module}.weight_global_scale"],
        )
    return weights


MODELOPT = {"FP8": "FP8", "NVFP4": "NVFP4A16"}
KV_SCALES = {"k": 0.5, "v": 0.25}


@pytest.mark.parametrize("algorithm", sorted(MODELOPT))
def test_a_modelopt_checkpoint_decodes_as_its_compressed_tensors_twin(algorithm, tmp_path):
    """NVIDIA ModelOpt's FP8 (a scale per tensor, a scalar) and NVFP4 (codes under weight,
    weight_scale_2 the reciprocal of compressed-tensors' weight_global_scale, as the library's
    converter of ModelOpt checkpoints reads it) with hf_quant_config.json beside config.json,
    activation and KV cache scales left unused: each weight is the compressed-tensors twin's."""
    reference = compressed(random_model("llama"), MODELOPT[algorithm], tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    parameters = dict(reference.named_parameters())
    weights = {n: parameters[n] for n in parameters if n.endswith("_proj.weight")}
    if algorithm == "NVFP4":
        weights = _nvfp4_weights(tensors, SCHEMES_ARGS["nvfp4"]())
        reference.load_state_dict(weights, strict=False)
    for name in list(tensors):
        module, _, kind = name.rpartition(".")
        if kind == "weight_packed":
            tensors[f"{module}.weight"] = tensors.pop(name)
        elif kind == "weight_global_scale":
            tensors[f"{module}.weight_scale_2"] = 1 / tensors.pop(name)
        elif kind == "weight_scale" and algorithm == "FP8":
            tensors[name] = tensors[name].reshape(())
        if module.endswith(("k_proj", "v_proj")) and kind == "weight_scale":  # ModelOpt's
            tensors[f"{module}.{module[-6]}_scale"] = torch.tensor(KV_SCALES[module[-6]])
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    quantization = {"quant_algo": algorithm, "kv_cache_quant_algo": "FP8", "group_size": 16}
    beside = {"producer": {"name": "modelopt"}, "quantization": quantization}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(beside))
    assert read_model_config(tmp_path).checkpoint_quantization.method == "modelopt"
    dequantizes_as(tmp_path, weights)
    decodes_as(tmp_path, reference, world_sizes=(1, 2) if algorithm == "NVFP4" else (1,))
    # An fp8 cache takes the projections' KV cache scales as the attention's.
    layer = load_model(tmp_path, kv_cache_dtype=torch.float8_e4m3fn).layers[1]
    assert (float(layer.k_scale), float(layer.v_scale)) == (KV_SCALES["k"], KV_SCALES["v"])


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
    parameters = dict(reference.named_parameters())
    projections = {n: parameters[n] for n in parameters if n.endswith("_proj.weight")}
    if scheme == "nvfp4":  # the library decompresses it into bfloat16: its float32 arithmetic
        projections = _nvfp4_weights(tensors, SCHEMES_ARGS["nvfp4"]())
        reference.load_state_dict(projections, strict=False)
    dequantizes_as(tmp_path, projections)
    world_sizes = (1, 2) if scheme in ("w4a16-asym", "nvfp4") else (1,)
    decodes_as(tmp_path, reference, world_sizes=world_sizes)


def _quantized_projections(
    tensors: dict, bits: int, group_size: int, *, act_order=False, sym=False
):
    """Each projection's [out, in] weight quantized to unsigned ``bits``-bit codes by round to
    nearest, a scale and zero point per output and group of inputs (its inputs' groups in a
    random order with ``act_order``, as GPTQ's desc_act leaves them); yields (name, codes,
    zeros [out, groups], scales [out, groups] as float16 rounds them, each input's group)."""
    generator = torch.Generator().manual_seed(bits)
    top = (1 << bits) - 1
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        weight = tensors[name]
        inputs = weight.shape[1]
        size = inputs if group_size == -1 else group_size
        order = torch.randperm(inputs, generator=generator) if act_order else torch.arange(inputs)
        groups = torch.empty(inputs, dtype=torch.int32)
        groups[order] = torch.arange(inputs, dtype=torch.int32) // size
        low = torch.stack([weight[:, groups == g].amin(1) for g in range(inputs // size)], 1)
        high = torch.stack([weight[:, groups == g].amax(1) for g in range(inputs // size)], 1)
        if sym:
            scales = torch.maximum(low.abs(), high.abs()) / (top // 2)
            zeros = torch.full_like(scales, (top + 1) // 2, dtype=torch.int32)
        else:
            scales = (high - low) / top
            zeros = (-low / scales).round().clamp(1, top).to(torch.int32)
        scales = scales.half().float()
        codes = (weight / scales[:, groups]).round() + zeros[:, groups]
        yield name, codes.clamp(0, top).to(torch.int32), zeros, scales, groups


def _signed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes as the library's packer takes them (it adds 2^(bits-1) back)."""
    return (codes - (1 << (bits - 1))).to(torch.int8)


def _dequantized(codes, zeros, scales, groups) -> torch.Tensor:
    return (codes - zeros[:, groups]).float() * scales[:, groups]


def _save_quantized(path, tensors: dict, quantization: dict, beside: str | None = None) -> None:
    """``tensors`` saved with ``quantization`` in config.json, or in the file ``beside`` it
    (older AutoGPTQ and AutoAWQ checkpoints)."""
    save_file(tensors, path / "model.safetensors")
    if beside is not None:
        (path / beside).write_text(json.dumps(quantization))
        return
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


GPTQ_CASES = {
    "int4-v1-desc-act": dict(bits=4, group_size=32, act_order=True, fmt="gptq"),
    "int4-v1-sym-moe": dict(bits=4, group_size=32, sym=True, fmt="gptq", kind="qwen3_moe"),
    "int8-v2-channel": dict(bits=8, group_size=-1, fmt="gptq_v2"),
    "int3-v1": dict(bits=3, group_size=64, act_order=True, fmt="gptq", beside=True),
}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_a_gptq_checkpoint_decodes_as_its_codes_dequantize(case, tmp_path):
    """AutoGPTQ's and GPTQModel's layout: qweight [in x bits / 32, out], each output's codes
    packed down its inputs (by the library's packer: a little-endian stream, 3-bit codes
    across words), qzeros [groups, out x bits / 32] (less one in the v1 format), float16
    scales [groups, out], g_idx; its config in config.json or, as older AutoGPTQ wrote it,
    quantize_config.json; the reference, which transformers loads, has each weight its code
    less its group's zero point times its scale (every expert's too)."""
    spec = dict(GPTQ_CASES[case])
    bits, group_size, fmt = spec.pop("bits"), spec.pop("group_size"), spec.pop("fmt")
    beside = "quantize_config.json" if spec.pop("beside", False) else None
    gptq, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    model = random_model(spec.pop("kind", "llama"))
    model.save_pretrained(gptq)
    model.save_pretrained(dequantized)
    tensors = load_file(gptq / "model.safetensors")
    reference = {**tensors}
    offset = 1 if fmt == "gptq" else 0
    for name, codes, zeros, scales, groups in list(
        _quantized_projections(tensors, bits, group_size, **spec)
    ):
        module = name.removesuffix(".weight")
        del tensors[name]
        tensors[f"{module}.qweight"] = pack_to_int32(_signed(codes.T, bits), bits, packed_dim=0)
        tensors[f"{module}.qzeros"] = pack_to_int32(_signed(zeros.T - offset, bits), bits)
        tensors[f"{module}.scales"] = scales.T.half().contiguous()
        tensors[f"{module}.g_idx"] = groups
        reference[name] = _dequantized(codes, zeros, scales, groups)
    quantization = {"quant_method": "gptq", "bits": bits, "group_size": group_size}
    quantization |= {"desc_act": spec.get("act_order", False), "sym": spec.get("sym", False)}
    _save_quantized(gptq, tensors, quantization | {"checkpoint_format": fmt}, beside)
    save_file(reference, dequantized / "model.safetensors")
    dequantizes_as(gptq, {n: t for n, t in reference.items() if n.endswith("_proj.weight")})
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    decodes_as(gptq, model.eval(), world_sizes=(1, 2) if case == "int4-v1-desc-act" else (1,))


def _awq_words(codes: torch.Tensor) -> torch.Tensor:
    """[n, columns] 4-bit codes -> [n, columns / 8] int32 in AutoAWQ's GEMM order: a word's
    k-th code (from its lowest bits) is column (0, 2, 4, 6, 1, 3, 5, 7)[k] of its eight."""
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for k, column in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        words |= codes[:, column::8].long() << (4 * k)
    return words.to(torch.int32)  # wraps a top code of 8 or more into the sign bit, as int32 does


# Asked to dequantize, transformers warns that the file's own config is used otherwise.
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_an_awq_checkpoint_decodes_as_the_library_converts_it(tmp_path):
    """AutoAWQ's GEMM layout (qweight [in, out / 8] interleaved, qzeros [groups, out / 8],
    float16 scales [groups, out]); the reference is compressed-tensors' converter of AutoAWQ
    checkpoints, whose output transformers loads and the library decompresses."""
    model = random_model("llama")
    awq, converted = tmp_path / "awq", tmp_path / "converted"
    model.save_pretrained(awq)
    tensors = load_file(awq / "model.safetensors")
    for name, codes, zeros, scales, _ in list(_quantized_projections(tensors, 4, 32)):
        module = name.removesuffix(".weight")
        del tensors[name]
        tensors[f"{module}.qweight"] = _awq_words(codes.T)
        tensors[f"{module}.qzeros"] = _awq_words(zeros.T)
        tensors[f"{module}.scales"] = scales.T.half().contiguous()
    quantization = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    _save_quantized(awq, tensors, quantization | {"version": "gemm"})
    converter = AutoAWQConverter.from_autoawq_config(quantization)
    convert_checkpoint(awq, converted, converter, max_workers=1, device="cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        converted,
        dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
    ).eval()
    assert type(reference.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    parameters = dict(reference.named_parameters())
    # The library dequantizes in its scales' float16: the same products, rounded once more.
    projections = {n: parameters[n] for n in parameters if n.endswith("_proj.weight")}
    dequantizes_as(awq, projections, torch.float16)
    decodes_as(awq, reference)
    # vLLM's names of its kernels for the checkpoint only say what it is; another is refused.
    for flag in ("awq", "awq_marlin"):
        assert (
            ModelRunner(awq, quantization=flag, kv_cache_memory_bytes=1 << 20).quantization is None
        )
    with pytest.raises(ValueError, match="--quantization gptq names a gptq checkpoint, but"):
        ModelRunner(awq, quantization="gptq", kv_cache_memory_bytes=1 << 20)
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="states no quantization_config"):
        ModelRunner(tmp_path / "plain", quantization="awq")


BNB = {
    "nf4-double": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


@pytest.mark.parametrize("case", sorted(BNB))
def test_a_bitsandbytes_checkpoint_decodes_as_the_library_dequantizes_it(case, tmp_path):
    """transformers quantizes a model with bitsandbytes on the CPU and saves it quantized
    (4-bit NF4 doubly quantized, as Unsloth's -bnb-4bit releases; FP4; LLM.int8()); the
    reference's weights are each layer's as the library dequantizes it."""
    bnb = pytest.importorskip("bitsandbytes")
    random_model("llama").save_pretrained(tmp_path / "source")
    config = transformers.BitsAndBytesConfig(**BNB[case], bnb_4bit_compute_dtype=torch.float32)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "source", dtype=torch.float32, device_map="cpu", quantization_config=config
    )
    quantized.save_pretrained(tmp_path / "bnb")
    dequantized = {}
    for name, module in quantized.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, bnb.nn.Linear4bit):
            dequantized[f"{name}.weight"] = bnb.functional.dequantize_4bit(
                weight, weight.quant_state
            )
        elif isinstance(module, bnb.nn.Linear8bitLt):
            dequantized[f"{name}.weight"] = bnb.functional.int8_vectorwise_dequant(
                weight, weight.SCB
            )
    assert len(dequantized) == 14  # two layers' seven projections
    dequantizes_as(tmp_path / "bnb", dequantized)
    reference = random_model("llama")
    reference.load_state_dict(dequantized, strict=False)
    decodes_as(tmp_path / "bnb", reference, world_sizes=(1, 2) if case == "nf4-double" else (1,))


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
    weight = DequantizedWeight("w", DenseCodes(_Source(codes)), (100, 70), scale, None, blocks)
    assert torch.equal(weight[(slice(None),)], want)
    assert torch.equal(weight[(slice(30, 90), slice(10, 66))], want[30:90, 10:66])
    with pytest.raises(ValueError, match=r"w: scales \(2, 2\) do not cover a \(100, 70\) weight"):
        other = CheckpointQuantization("fp8", (32, 64), ("block",))
        DequantizedWeight("w", DenseCodes(_Source(codes)), (100, 70), scale, None, other)


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


def test_autoawqs_own_config_file_and_keys_are_read(tmp_path):
    """AutoAWQ's quant_config.json beside a config.json without a quantization_config, in
    its own keys (w_bit, q_group_size)."""
    random_model("llama").config.save_pretrained(tmp_path)
    own = {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}
    (tmp_path / "quant_config.json").write_text(json.dumps(own))
    quantization = read_model_config(tmp_path).checkpoint_quantization
    assert quantization == CheckpointQuantization("awq", None, ("group",), (4,), True)
    (tmp_path / "quant_config.json").write_text(json.dumps({**own, "w_bit": 3}))
    with pytest.raises(ValueError, match="AWQ gemm checkpoint of 3-bit weights"):
        read_model_config(tmp_path)


class _File:
    """Tensors in memory as safetensors' opened file of them."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def get_slice(self, name: str) -> _Source:
        return _Source(self.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _packed_module(method: str, bits: int) -> tuple[dict, torch.Tensor]:
    """A 40 x 96 layer's GPTQ (3-bit v2, activation order) or AWQ tensors under "m", and the
    weight they hold."""
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    (_, codes, zeros, scales, groups), *_ = _quantized_projections(
        {"m.up_proj.weight": weight}, bits, 32, act_order=method == "gptq"
    )
    tensors = {"m.scales": scales.T.half().contiguous()}
    if method == "gptq":
        tensors["m.qweight"] = pack_to_int32(_signed(codes.T, bits), bits, packed_dim=0)
        tensors["m.qzeros"] = pack_to_int32(_signed(zeros.T, bits), bits)
        tensors["m.g_idx"] = groups
    else:
        tensors["m.qweight"], tensors["m.qzeros"] = _awq_words(codes.T), _awq_words(zeros.T)
    return tensors, _dequantized(codes, zeros, scales, groups)


@pytest.mark.parametrize(("method", "bits"), [("gptq", 3), ("gptq", 4), ("awq", 4)])
def test_a_packed_layer_reads_any_rows_and_columns(method, bits):
    """A rank's share of a GPTQ or AWQ weight, its bounds inside a word's codes."""
    tensors, want = _packed_module(method, bits)
    config = {"quant_method": method, "bits": bits, "checkpoint_format": "gptq_v2"}
    quantization = read_checkpoint_quantization({"quantization_config": config}, "llama")
    weight = packed_linear_weight("m.qweight", dict.fromkeys(tensors, _File(tensors)), quantization)
    assert weight.get_shape() == [40, 96]
    assert torch.equal(weight[(slice(None),)], want)
    for rows, columns in [(slice(3, 37), slice(5, 91)), (slice(9, 10), slice(33, 34))]:
        assert torch.equal(weight[(rows, columns)], want[rows, columns])


@pytest.mark.parametrize(
    ("method", "change", "error"),
    [
        ("gptq", {"m.scales": None}, "m.qweight: the checkpoint has no floating-point 2-D m.sc"),
        ("gptq", {"m.qzeros": None}, "m.qweight: the checkpoint has no m.qzeros"),
        ("gptq", {"m.qzeros": torch.zeros(3, 4, dtype=torch.int32)}, "does not pack the 3 x 40"),
        ("gptq", {"m.g_idx": torch.zeros(96)}, "m.g_idx: torch.float32 .96,. is no 1-D integer"),
        ("gptq", {"m.g_idx": torch.arange(96) // 16}, "do not give each of its 96 columns one of"),
        ("gptq", {"m.g_idx": torch.arange(64) // 32}, r"\[12, 40\] int32 does not pack 64 x 40"),
        ("awq", {"m.qweight": torch.zeros(96, 4, dtype=torch.int32)}, "the 40 columns of its"),
        ("awq", {"m.qzeros": None}, "m.qweight: the checkpoint has no m.qzeros"),
    ],
)
def test_a_packed_layer_that_does_not_fit_is_refused_by_name(method, change, error):
    tensors, _ = _packed_module(method, 4)
    for name, tensor in change.items():
        tensors.pop(name) if tensor is None else tensors.__setitem__(name, tensor)
    config = {"quant_method": method, "bits": 4, "zero_point": True}
    quantization = read_checkpoint_quantization({"quantization_config": config}, "llama")
    with pytest.raises(ValueError, match=error):
        packed_linear_weight("m.qweight", dict.fromkeys(tensors, _File(tensors)), quantization)


@pytest.mark.parametrize(
    ("quantization", "error"),
    [
        ({"quant_method": "hqq"}, "quant_method 'hqq' is not read"),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True},
            "a bitsandbytes checkpoint of load_in_4bit True, load_in_8bit True",
        ),
        (
            {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "bnb_4bit_quant_storage": "bfloat16",
            },
            "4-bit storage bfloat16",
        ),
        ({"quant_method": "gptq", "bits": 6}, r"GPTQ gptq checkpoint of \[6\]-bit weights"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "GPTQ marlin checkpoint",
        ),
        ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int8"}, "pack_dtype 'int8'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ gemv checkpoint"),
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
