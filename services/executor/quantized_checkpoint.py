"""A quantized checkpoint's tensors read as the unquantized checkpoint's (see
`weir.shared.checkpoint_quantization` for the formats).

Each quantized weight ``X.weight`` (FP8 or INT8 codes, or ``X.weight_packed``: integers of
``b`` bits packed densely into int32, the row's element ``e`` at bit ``e * b``, offset by
``2^(b-1)``; or GPTQ's and AWQ's ``X.qweight``, `gptq_checkpoint`) is yielded under its
plain name as a `DequantizedWeight`; its scales, zero points and the unused activation and
KV cache scales are not yielded. The scale of a weight may sit in another file of a sharded
checkpoint: every file is open while they are read. GPTQ's activation order, as older
compressed-tensors versions saved it (``weight_g_idx``), is refused.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from weir.services.executor.bnb_checkpoint import BNB_PARTS, bnb_weight
from weir.services.executor.dequantized_weight import (
    Codes,
    DenseCodes,
    DequantizedWeight,
    FP4Codes,
    PackedRows,
    packed_width,
    unpack_int32,
)
from weir.services.executor.gptq_checkpoint import PACKED_LINEAR_PARTS, packed_linear_weight
from weir.shared.checkpoint_quantization import CheckpointQuantization

if TYPE_CHECKING:  # weights.py reads its quantized checkpoints through this module
    from weir.services.executor.weights import TensorSource

# safetensors' names of the dtypes of codes.
_CODES = ("F8_E4M3", "F8_E5M2", "I8")
# A quantized module's tensors besides its codes: read with them, not loaded on their own.
_PARTS: tuple[str, ...] = (".weight_scale_inv", ".weight_scale", ".weight_zero_point")
_PARTS += (".weight_shape", ".weight_global_scale", ".weight_scale_2")  # NVFP4's last two
# Scales of activations and of attention's queries and probabilities, which Weir keeps in
# the model's dtype (an fp8 KV cache's k_scale and v_scale go to the loader, which takes them
# where the cache uses them).
_UNUSED: tuple[str, ...] = (".input_scale", ".input_zero_point", ".output_scale")
_UNUSED += (".activation_scale", ".q_scale", ".prob_scale", ".input_global_scale")


class WeightReader(Protocol):
    """A layout's reader: the quantized weight a tensor's name is the codes of, else None."""

    def __call__(
        self, name: str, where: dict[str, Any], quantization: CheckpointQuantization
    ) -> DequantizedWeight | None: ...


def dequantized_tensors(
    opened: list[Any], quantization: CheckpointQuantization
) -> Iterator[tuple[str, "TensorSource"]]:
    """Every tensor of the checkpoint's opened files, lazily, quantized weights dequantized
    (under their plain names, ``X.weight``)."""
    where = {name: f for f in opened for name in f.keys()}
    parts, read = _LAYOUTS[quantization.method]
    for f in opened:
        for name in f.keys():
            if name.endswith(parts + _UNUSED):
                continue
            weight = read(name, where, quantization)
            if weight is None:
                yield name, f.get_slice(name)
            else:
                yield weight.name, weight


def scaled_weight(
    name: str, where: dict[str, Any], quantization: CheckpointQuantization
) -> DequantizedWeight | None:
    """An fp8 or compressed-tensors weight: FP8 or INT8 codes beside their scale, or
    integers packed into int32 (``weight_packed``)."""
    module, _, kind = name.rpartition(".")
    if kind == "weight_g_idx":
        raise ValueError(
            f"{name}: GPTQ's activation order (group indices) is not read; take a "
            'checkpoint quantized without it (actorder null or "weight")'
        )
    scaled = f"{module}.weight_scale" in where or f"{module}.weight_scale_inv" in where
    if kind == "weight_packed" or (kind == "weight" and scaled):
        return _weight(module, kind, where, quantization)
    return None


def _weight(
    module: str, kind: str, where: dict[str, Any], quantization: CheckpointQuantization
) -> "DequantizedWeight":
    """A quantized weight's codes, scales and zero points, each checked against the others
    and against what config.json says (ValueError names the tensor)."""

    def part(name: str) -> torch.Tensor | None:
        name = f"{module}.{name}"
        return where[name].get_tensor(name) if name in where else None

    name = f"{module}.{kind}"
    codes = where[name].get_slice(name)
    dtype, shape = codes.get_dtype(), codes.get_shape()
    fp4 = quantization.fp4 and dtype == "U8"
    packed = kind == "weight_packed" and not fp4
    if len(shape) != 2 or not fp4 and (dtype != "I32" if packed else dtype not in _CODES):
        raise ValueError(
            f"{name}: {dtype} {shape} is not a quantized weight's codes (2-D "
            + ("int32)" if packed else "FP8 or INT8, as its scale says)")
        )
    scale = part("weight_scale_inv")
    scale = part("weight_scale") if scale is None else scale
    mx = fp4 and scale is not None and scale.dtype == torch.uint8
    if mx and scale is not None:  # MXFP4's scales: E8M0, powers of two by biased exponents
        scale = torch.exp2(scale.float() - 127)
    if scale is None or not scale.is_floating_point() or scale.dim() > 2:
        raise ValueError(
            f"{name} is quantized ({dtype}) but the checkpoint has no floating-point "
            f"{module}.weight_scale_inv or {module}.weight_scale of at most 2 dimensions"
        )
    rows, columns = shape
    reader: Codes = DenseCodes(codes)
    if fp4:
        columns *= 2
        reader = FP4Codes(codes, columns)
    if fp4 and not mx:
        scale = _nvfp4_scale(module, scale, part("weight_global_scale"), part("weight_scale_2"))
    zero_point = part("weight_zero_point")
    if packed:
        logical = part("weight_shape")
        if logical is None or logical.numel() != 2 or logical.is_floating_point():
            raise ValueError(f"{name} has no [rows, columns] integer weight_shape")
        rows, columns = (int(n) for n in logical)
        bits = packed_width(name, (rows, columns), shape, quantization.num_bits)
        reader = PackedRows(codes, bits, columns)
        if zero_point is not None and zero_point.dtype == torch.int32:  # packed by columns
            zero_point = unpack_int32(zero_point.T, bits, rows).T
    integer = packed or dtype == "I8"
    if integer and quantization.asymmetric is not None:
        if quantization.asymmetric != (zero_point is not None):
            has = "has no" if zero_point is None else "has a"
            kind_ = "asymmetric" if quantization.asymmetric else "symmetric"
            raise ValueError(
                f"{name}: config.json says its integer weights are {kind_}, but it {has} "
                "weight_zero_point"
            )
    return DequantizedWeight(
        f"{module}.weight", reader, (rows, columns), scale, zero_point, quantization
    )


def _nvfp4_scale(
    module: str,
    scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    scale_2: torch.Tensor | None,
) -> torch.Tensor:
    """An NVFP4 weight's scale per 16 columns with its tensor's folded in: divided by
    compressed-tensors' weight_global_scale, or times ModelOpt's weight_scale_2."""
    if (global_scale is None) == (scale_2 is None):
        raise ValueError(
            f"{module}: NVFP4 codes need one weight_global_scale (compressed-tensors') or "
            "weight_scale_2 (ModelOpt's)"
        )
    if global_scale is not None:
        return scale.float() / global_scale.float().reshape(())
    assert scale_2 is not None
    return scale.float() * scale_2.float().reshape(())


_LAYOUTS: dict[str, tuple[tuple[str, ...], WeightReader]] = {
    "fp8": (_PARTS, scaled_weight),
    "compressed-tensors": (_PARTS, scaled_weight),
    "gptq": (PACKED_LINEAR_PARTS, packed_linear_weight),
    "awq": (PACKED_LINEAR_PARTS, packed_linear_weight),
    "bitsandbytes": (BNB_PARTS, bnb_weight),
    "modelopt": (_PARTS, scaled_weight),
}
