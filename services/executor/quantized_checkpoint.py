"""A quantized checkpoint's tensors read as the unquantized checkpoint's (see
`weir.shared.checkpoint_quantization` for the formats).

Each quantized weight ``X.weight`` (FP8 or INT8 codes, or ``X.weight_packed``: integers of
``b`` bits packed densely into int32, the row's element ``e`` at bit ``e * b``, offset by
``2^(b-1)``) is yielded under its plain name as a `DequantizedWeight`: codes, less their
zero points, times their scales, each scale covering a block of the weight (a tensor's
one, a row's, a group of a row's columns, or a rows x columns block). The loader asks it
for a rank's rows and columns only, as it asks any tensor; its scales, zero points and the
unused activation and KV cache scales are not yielded. The scale of a weight may sit in
another file of a sharded checkpoint: every file is open while they are read. GPTQ's activation order,
as older compressed-tensors versions saved it (``weight_g_idx``), is refused.
"""

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from weir.shared.checkpoint_quantization import CheckpointQuantization

if TYPE_CHECKING:  # weights.py reads its quantized checkpoints through this module
    from weir.services.executor.weights import TensorSource

# safetensors' names of the dtypes of codes.
_CODES = ("F8_E4M3", "F8_E5M2", "I8")
# A quantized module's tensors besides its codes: read with them, not loaded on their own.
_PARTS = ("weight_scale_inv", "weight_scale", "weight_zero_point", "weight_shape")
# Scales of activations and of attention's queries and probabilities, which Weir keeps in
# the model's dtype (an fp8 KV cache's k_scale and v_scale go to the loader, which takes them
# where the cache uses them).
_UNUSED: tuple[str, ...] = ("input_scale", "input_zero_point", "output_scale", "activation_scale")
_UNUSED += ("q_scale", "prob_scale")


def dequantized_tensors(
    opened: list[Any], quantization: CheckpointQuantization
) -> Iterator[tuple[str, "TensorSource"]]:
    """Every tensor of the checkpoint's opened files, lazily, quantized weights dequantized."""
    where = {name: f for f in opened for name in f.keys()}
    for f in opened:
        for name in f.keys():
            module, _, kind = name.rpartition(".")
            if kind == "weight_g_idx":
                raise ValueError(
                    f"{name}: GPTQ's activation order (group indices) is not read; take a "
                    'checkpoint quantized without it (actorder null or "weight")'
                )
            if kind in _PARTS or kind in _UNUSED:
                continue
            scaled = f"{module}.weight_scale" in where or f"{module}.weight_scale_inv" in where
            if kind == "weight_packed" or (kind == "weight" and scaled):
                yield f"{module}.weight", _weight(module, kind, where, quantization)
            else:
                yield name, f.get_slice(name)


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
    packed = kind == "weight_packed"
    if len(shape) != 2 or (dtype != "I32" if packed else dtype not in _CODES):
        raise ValueError(
            f"{name}: {dtype} {shape} is not a quantized weight's codes (2-D "
            + ("int32)" if packed else "FP8 or INT8, as its scale says)")
        )
    scale = part("weight_scale_inv")
    scale = part("weight_scale") if scale is None else scale
    if scale is None or not scale.is_floating_point() or scale.dim() > 2:
        raise ValueError(
            f"{name} is quantized ({dtype}) but the checkpoint has no floating-point "
            f"{module}.weight_scale_inv or {module}.weight_scale of at most 2 dimensions"
        )
    rows, columns = shape
    if packed:
        logical = part("weight_shape")
        if logical is None or logical.numel() != 2 or logical.is_floating_point():
            raise ValueError(f"{name} has no [rows, columns] integer weight_shape")
        rows, columns = (int(n) for n in logical)
    zero_point = part("weight_zero_point")
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
        f"{module}.weight", codes, (rows, columns), scale, zero_point, quantization
    )


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[n, words] int32 of ``bits``-bit integers packed as compressed-tensors packs them ->
    [n, count] int32, signed (their offset taken away)."""
    offset = 1 << (bits - 1)
    if 32 % bits == 0:  # 2, 4, 8 bits: whole codes in each word, read by shifts
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.flatten(1)[:, :count] - offset
    as_bytes = packed.contiguous().view(torch.uint8)  # little-endian: a word's low byte first
    shifts = torch.arange(8, dtype=torch.uint8)
    stream = ((as_bytes.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : count * bits]
    weights = 1 << torch.arange(bits, dtype=torch.int32)
    values = (stream.view(-1, count, bits).to(torch.int32) * weights).sum(-1, dtype=torch.int32)
    return values - offset


class DequantizedWeight:
    """A quantized [rows, columns] weight as a `TensorSource` of float32 values."""

    def __init__(
        self,
        name: str,
        codes: Any,
        shape: tuple[int, int],
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        quantization: CheckpointQuantization,
    ) -> None:
        self.name, self.codes, self.shape = name, codes, shape
        rows, _ = shape
        self.bits = None if codes.get_dtype() != "I32" else self._bits(quantization.num_bits)
        self.scale = _grid(scale.float(), rows)
        self.block = self._block(quantization)
        self.zero_point = None
        if zero_point is not None:
            if zero_point.dtype == torch.int32 and self.bits is not None:  # packed by columns
                zero_point = unpack_int32(zero_point.T, self.bits, self.scale.shape[0]).T
            self.zero_point = _grid(zero_point.float(), rows)
            if self.zero_point.shape != self.scale.shape:
                raise ValueError(
                    f"{name}: zero points {tuple(self.zero_point.shape)} do not match its "
                    f"scales {tuple(self.scale.shape)}"
                )

    def _bits(self, widths: tuple[int, ...]) -> int:
        """The packed codes' width: the one of config.json's (else of 2 to 8) whose dense
        packing of a row takes the words each row of the codes has."""
        (rows, columns), (packed_rows, words) = self.shape, self.codes.get_shape()
        fits = [b for b in widths or range(2, 9) if math.ceil(columns * b / 32) == words]
        if packed_rows != rows or len(fits) != 1:
            raise ValueError(
                f"{self.name}_packed: [{packed_rows}, {words}] int32 does not pack "
                f"{self.shape} weights of {widths or 'a width of 2 to 8'} bits"
            )
        return fits[0]

    def _block(self, quantization: CheckpointQuantization) -> tuple[int, int]:
        """The rows and columns each scale covers, checked against the scale's grid and
        the scale layouts config.json names."""
        (rows, columns), (grid_rows, grid_columns) = self.shape, self.scale.shape
        block_size = quantization.block_size
        kinds: tuple[str, ...]
        if (grid_rows, grid_columns) == (1, 1):
            kinds, block = ("tensor", "block"), (rows, columns)
        elif grid_rows == rows and columns % grid_columns == 0:  # a row's, or a group's
            kinds = ("channel", "group") if grid_columns == 1 else ("group",)
            block = (1, columns // grid_columns)
        elif block_size is not None:
            kinds, block = ("block",), block_size
        else:
            kinds, block = ("block",), (rows // grid_rows, columns // grid_columns)
        named = quantization.strategies
        if (
            not block[0]
            or not block[1]
            or (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
            != (grid_rows, grid_columns)
            or (named and not set(kinds) & set(named))
        ):
            raise ValueError(
                f"{self.name}: scales {tuple(self.scale.shape)} do not cover a {self.shape} "
                f"weight by {' or '.join(named) or 'any layout'}"
                + ("" if block_size is None else f" (blocks of {block_size})")
            )
        return block

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows, columns = (*index, slice(None))[:2]
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = columns.indices(self.shape[1])
        codes: torch.Tensor  # read from the checkpoint's (untyped) slice
        if self.bits is None:
            codes = self.codes[(slice(r0, r1), slice(c0, c1))]
        else:
            packed = self.codes[(slice(r0, r1),)]
            codes = unpack_int32(packed, self.bits, self.shape[1])[:, c0:c1]
        scale_rows = torch.arange(r0, r1) // self.block[0]
        scale_columns = torch.arange(c0, c1) // self.block[1]
        values = codes.float()
        if self.zero_point is not None:
            values -= self.zero_point[scale_rows][:, scale_columns]
        return values * self.scale[scale_rows][:, scale_columns]


def _grid(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A scale (or zero point) tensor as its 2-D grid over the weight: one value a tensor
    [1, 1], a row's [rows, 1]."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    return scale.reshape(rows, 1) if scale.dim() == 1 else scale
