"""Which quantized checkpoints Weir reads, from config.json's ``quantization_config``.

Weir computes in the model's dtype: a quantized checkpoint's weights are dequantized as they
load (`weir.services.executor.quantized_checkpoint`), so it takes the memory of the
unquantized model and gives its outputs on the dequantized weights. Read:

- ``fp8``: the FP8 releases of DeepSeek and Qwen (Qwen3-8B-FP8, ...) and transformers'
  FineGrainedFP8: E4M3 weights with a scale per block (``weight_block_size``, 128 x 128,
  as ``weight_scale_inv``), or one scale per tensor (``weight_scale``, as vLLM writes them).
- ``compressed-tensors`` (llm-compressor's: RedHat's ``-FP8-dynamic``, ``-quantized.w4a16``,
  ``-quantized.w8a8``, ...): FP8 or INT8 weights, or INT4-INT8 packed in int32
  (``weight_packed``), with scales per tensor, channel, group or block, and zero points
  where asymmetric.
- ``gptq`` (AutoGPTQ's and GPTQModel's ``-GPTQ-Int4``/``-Int8`` releases): 2-, 3-, 4- or
  8-bit codes packed along the input rows, a scale and a zero point per group of input
  rows, the groups in activation order where ``desc_act`` (``g_idx``), zero points stored
  less one (``checkpoint_format`` ``gptq``) or as they are (``gptq_v2``); GPTQModel's
  per-module ``dynamic`` widths.
- ``awq`` (AutoAWQ's ``-AWQ`` releases, its GEMM layout): 4-bit codes packed along the
  output columns, interleaved, a scale and a zero point per group of input rows
  (`gptq_checkpoint` reads both).
- ``bitsandbytes`` (transformers' ``load_in_4bit`` and ``load_in_8bit`` models saved
  quantized, Unsloth's ``-bnb-4bit`` releases): NF4 or FP4 codes with a scale per block,
  doubly quantized or not, and LLM.int8()'s int8 rows (`bnb_checkpoint`).
- ``modelopt`` (NVIDIA's ``-FP8`` and ``-FP4`` releases, in config.json or
  ``hf_quant_config.json``): FP8 weights with a scale per tensor, or NVFP4's (E2M1 codes
  two a byte, an FP8 scale per 16 columns times ``weight_scale_2``); compressed-tensors'
  ``nvfp4-pack-quantized`` is the same with the reciprocal, ``weight_global_scale``, and its
  ``mxfp4-pack-quantized`` the same codes with an E8M0 scale per 32 columns.
- ``mxfp4``: gpt-oss as OpenAI publishes it (`gpt_oss_checkpoint`).

Activation scales (``input_scale``) are not used: activations stay in the model's dtype. An
FP8 KV cache's scales (compressed-tensors' ``kv_cache_scheme``: ``k_scale`` and ``v_scale``
of each layer's attention) are used with ``--kv-cache-dtype fp8`` and skipped without it.
Anything else (Marlin's and AWQ's GEMV layouts, sparse or rotated
compressed-tensors models) is refused by name before any process loads a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("fp8", "compressed-tensors", "mxfp4", "gptq", "awq", "bitsandbytes", "modelopt")
# compressed-tensors' formats whose weights are codes times scales (less zero points).
COMPRESSED_TENSORS_FORMATS = (
    "float-quantized",
    "int-quantized",
    "naive-quantized",
    "pack-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "dense",
)
# (type, num_bits) of the weights read: FP8, and integers of 2 to 8 bits; NVFP4's E2M1
# (its own format only).
_BITS = {("float", 8), *(("int", bits) for bits in range(2, 9))}
# compressed-tensors' FP4 formats and their weights' strategies: NVFP4's scales per 16
# columns (tensor_group: divided by the tensor's global scale), MXFP4's E8M0 per 32.
_FP4 = {"nvfp4-pack-quantized": "tensor_group", "mxfp4-pack-quantized": "group"}


# How a weight's scales cover it: one for the tensor, one per row (channel), one per group of
# a row's columns, one per rows x columns block.
STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """What config.json says of a quantized checkpoint's weights, which each quantized
    tensor must agree with (a tensor that does not is refused by name)."""

    method: str  # one of METHODS
    # (rows, columns) of a scale's block where config.json gives them: a weight whose shape
    # is no multiple of its scale grid's is read by these (the last block is cut short).
    block_size: tuple[int, int] | None = None
    strategies: tuple[str, ...] = ()  # of STRATEGIES: the scale layouts its groups name
    num_bits: tuple[int, ...] = ()  # the widths of its integer weights
    # Whether its integer weights have zero points: every group's yes (True) or no (False),
    # None where the groups differ.
    asymmetric: bool | None = False
    # compressed-tensors' kv_cache_scheme: None without one, "tensor" for static FP8 scales
    # per tensor (a layer's k_scale and v_scale, which an fp8 cache applies), else what it is.
    kv_cache_scales: str | None = None
    # What each stored zero point lacks: 1 in GPTQ's v1 checkpoints (AutoGPTQ stored every
    # zero point less one), else 0.
    zero_point_offset: int = 0
    # Whether weights may be NVFP4's E2M1 codes, two a byte (uint8).
    fp4: bool = False


# vLLM's --quantization names of the checkpoints Weir reads, and the method each names: given,
# the flag only says what the checkpoint is (vLLM's kernels for it), which it must be.
CHECKPOINT_FLAGS = {
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "bitsandbytes": "bitsandbytes",
    "modelopt": "modelopt",
    "modelopt_fp4": "modelopt",
    "mxfp4": "mxfp4",
}


def weight_quantization(flag: str | None, checkpoint: CheckpointQuantization | None) -> str | None:
    """What ``--quantization`` asks of the loaded weights: Weir's own method (int8), or None
    where it names the checkpoint's (read as it is, dequantized); ValueError where it names
    another, as vLLM refuses a flag its model's config contradicts."""
    if flag not in CHECKPOINT_FLAGS:
        return flag
    method = CHECKPOINT_FLAGS[flag]
    if checkpoint is not None and checkpoint.method == method:
        return None
    stated = "no quantization_config" if checkpoint is None else f"{checkpoint.method!r}"
    raise ValueError(
        f"--quantization {flag} names a {method} checkpoint, but the model's config.json states "
        f"{stated}: Weir reads a quantized checkpoint by its config.json (leave --quantization "
        "out) and quantizes no weights itself but with int8 on a CPU"
    )


def read_checkpoint_quantization(
    hf: dict[str, Any], model_type: str
) -> CheckpointQuantization | None:
    """config.json's ``quantization_config`` checked; None for an unquantized checkpoint.
    ValueError names what Weir does not read."""
    config = hf.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    if method not in METHODS or (method == "mxfp4") != (model_type == "gpt_oss"):
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not read; Weir "
            "reads fp8, compressed-tensors, GPTQ, AWQ and bitsandbytes checkpoints (and "
            "gpt-oss' mxfp4): take the model's unquantized, FP8, GPTQ, AWQ or llm-compressor "
            "(w4a16, w8a8) release"
        )
    if method == "fp8":
        block = _block(config.get("weight_block_size"), method)
        return CheckpointQuantization(method, block, ("tensor",) if block is None else ("block",))
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    if method == "bitsandbytes":
        return _bitsandbytes(config)
    if method == "modelopt":
        return _modelopt(config)
    return CheckpointQuantization(method)


def _block(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(type(v) is int and v > 0 for v in value)
    ):
        raise ValueError(
            f"config.json: {where}'s block size must be [rows, columns], got {value!r}"
        )
    return value[0], value[1]


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuantization:
    """A compressed-tensors config, every group checked to be one Weir dequantizes."""
    for key in ("sparsity_config", "transform_config"):
        if config.get(key):
            raise ValueError(
                f"config.json: a compressed-tensors checkpoint with a {key} (sparse or "
                "rotated weights) is not read"
            )
    groups = config.get("config_groups")
    kv_cache_scales = _kv_cache_scales(config.get("kv_cache_scheme"))
    # A checkpoint of KV cache scales alone quantizes no weights.
    if not isinstance(groups, dict) or not (groups or kv_cache_scales):
        raise ValueError("config.json: compressed-tensors' config_groups must be an object")
    blocks: set[tuple[int, int]] = set()
    strategies: set[str] = set()
    bits: set[int] = set()
    symmetric: set[bool] = set()
    fp4 = False
    for name, group in groups.items():
        where = f"compressed-tensors' config group {name!r}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ValueError(f"config.json: {where} quantizes no weights")
        fmt = group.get("format") or config.get("format")
        weights = group["weights"]
        kind, width = weights.get("type"), weights.get("num_bits")
        strategy = weights.get("strategy")
        if fmt in _FP4 and (kind, width, strategy) == ("float", 4, _FP4[fmt]):
            strategy, fp4 = "group", True
        elif (
            fmt not in COMPRESSED_TENSORS_FORMATS
            or fmt in _FP4
            or (kind, width) not in _BITS
            or strategy not in STRATEGIES
        ):
            raise ValueError(
                f"config.json: {where} is {fmt} {kind} {width}-bit weights by {strategy}; Weir "
                f"reads {', '.join(COMPRESSED_TENSORS_FORMATS[:-3])} FP8 and INT2-INT8 weights "
                f"by {', '.join(STRATEGIES)}, and FP4 weights of "
                + " and ".join(f"{f} by {s}" for f, s in _FP4.items())
            )
        strategies.add(strategy)
        if kind == "int":
            bits.add(width)
            symmetric.add(weights.get("symmetric", True) is not False)
        block = _block(weights.get("block_structure"), where)
        if block is not None:
            blocks.add(block)
    if len(blocks) > 1:
        raise ValueError(f"config.json: compressed-tensors' groups use several blocks {blocks}")
    return CheckpointQuantization(
        "compressed-tensors",
        next(iter(blocks), None),
        tuple(sorted(strategies)),
        tuple(sorted(bits)),
        None if len(symmetric) > 1 else symmetric == {False},
        kv_cache_scales,
        fp4=fp4,
    )


# GPTQ's widths as vLLM reads them (GPTQModel's 5- to 7-bit codes are packed otherwise).
GPTQ_BITS = (2, 3, 4, 8)
# GPTQ's checkpoint formats: v1 stored each zero point less one, v2 as it is.
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}


def _gptq(config: dict[str, Any]) -> CheckpointQuantization:
    """A GPTQ config: its widths (GPTQModel's ``dynamic`` may give modules others; each
    weight's own is read off its shape) and checkpoint format."""
    fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
    dynamic = config.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
        raise ValueError(
            f"config.json: GPTQ's dynamic must map patterns to objects, got {dynamic!r}"
        )
    bits = {config.get("bits"), *(v["bits"] for v in dynamic.values() if "bits" in v)}
    if fmt not in _GPTQ_FORMATS or not bits <= set(GPTQ_BITS):
        raise ValueError(
            f"config.json: GPTQ {fmt} checkpoint of {sorted(bits, key=str)}-bit weights; Weir "
            f"reads gptq and gptq_v2 checkpoints of {', '.join(map(str, GPTQ_BITS))} bits"
        )
    if config.get("pack_dtype", "int32") != "int32":
        raise ValueError(
            f"config.json: GPTQ's pack_dtype {config['pack_dtype']!r} is not read (int32 is)"
        )
    strategy = "channel" if config.get("group_size", 128) == -1 else "group"
    return CheckpointQuantization(
        "gptq",
        strategies=(strategy,),
        num_bits=tuple(sorted(bits)),
        asymmetric=None,
        zero_point_offset=_GPTQ_FORMATS[fmt],
    )


def _awq(config: dict[str, Any]) -> CheckpointQuantization:
    """An AutoAWQ config (transformers' keys or AutoAWQ's own: ``w_bit``, ``q_group_size``):
    4-bit codes in its GEMM layout."""
    version = str(config.get("version") or "gemm").lower()
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4 or version != "gemm":
        raise ValueError(
            f"config.json: AWQ {version} checkpoint of {bits}-bit weights; Weir reads "
            "AutoAWQ's 4-bit GEMM layout (version gemm)"
        )
    group_size = config.get("group_size", config.get("q_group_size", 128))
    strategy = "channel" if group_size == -1 else "group"
    zero_point = config.get("zero_point", True) is not False
    return CheckpointQuantization(
        "awq", strategies=(strategy,), num_bits=(4,), asymmetric=zero_point
    )


def _bitsandbytes(config: dict[str, Any]) -> CheckpointQuantization:
    """A bitsandbytes config: 4-bit codes stored in bytes, or 8-bit ones."""
    four = bool(config.get("load_in_4bit", config.get("_load_in_4bit")))
    eight = bool(config.get("load_in_8bit", config.get("_load_in_8bit")))
    storage = config.get("bnb_4bit_quant_storage", "uint8")
    if four == eight or (four and storage != "uint8"):
        raise ValueError(
            f"config.json: a bitsandbytes checkpoint of load_in_4bit {four}, load_in_8bit "
            f"{eight}, 4-bit storage {storage}; Weir reads one of 4-bit codes stored in uint8 "
            "or 8-bit codes"
        )
    if four:
        return CheckpointQuantization("bitsandbytes", strategies=("group",), num_bits=(4,))
    return CheckpointQuantization("bitsandbytes", strategies=("channel",), num_bits=(8,))


# ModelOpt's weight formats: FP8 with a scale per tensor, NVFP4 (E2M1 with an FP8 scale per
# 16 columns, times a scale per tensor).
_MODELOPT_ALGORITHMS = {"FP8": ("tensor",), "NVFP4": ("group",)}


def _modelopt(config: dict[str, Any]) -> CheckpointQuantization:
    """A ModelOpt config, in config.json or hf_quant_config.json (its ``quantization``); an
    FP8 KV cache's scales (``kv_cache_quant_algo`` FP8) are one per tensor."""
    quantization = config.get("quantization", config)
    algorithm, kv_cache = quantization.get("quant_algo"), quantization.get("kv_cache_quant_algo")
    if algorithm not in _MODELOPT_ALGORITHMS:
        raise ValueError(
            f"config.json: ModelOpt's quant_algo {algorithm!r} is not read; Weir reads "
            f"{' and '.join(_MODELOPT_ALGORITHMS)}"
        )
    return CheckpointQuantization(
        "modelopt",
        strategies=_MODELOPT_ALGORITHMS[algorithm],
        kv_cache_scales=None if kv_cache is None else "tensor" if kv_cache == "FP8" else kv_cache,
        fp4=algorithm == "NVFP4",
    )


def _kv_cache_scales(scheme: Any) -> str | None:
    """What a ``kv_cache_scheme`` holds, as `CheckpointQuantization.kv_cache_scales` says."""
    if scheme is None:
        return None
    if not isinstance(scheme, dict):
        return repr(scheme)
    kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy")
    if (kind, bits) == ("float", 8) and strategy == "tensor" and not scheme.get("dynamic"):
        return "tensor"
    dynamic = "dynamic " if scheme.get("dynamic") else ""
    return f"{dynamic}{kind} {bits}-bit scales by {strategy}"
