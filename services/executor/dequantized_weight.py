"""A quantized weight read as float32 values: its codes, less their zero points, times their
scales, each scale (and zero point) covering a block of the [rows, columns] weight (a
tensor's one, a row's, a group of a row's columns, or a rows x columns block), or, in GPTQ's
activation order, the group each column names. The codes come from a `Codes` reader, one
for each layout checkpoints store them in (`quantized_checkpoint`, `gptq_checkpoint`); the
loader asks for a rank's rows and columns only, as it asks any tensor.
"""

import math
from typing import Any, Protocol

import torch

from weir.shared.checkpoint_quantization import CheckpointQuantization

# E2M1: the value of each 4-bit code (sign, two exponent bits, one mantissa bit).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1 = torch.tensor([*_E2M1_MAGNITUDES, *(-m for m in _E2M1_MAGNITUDES)])


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] of two E2M1 codes a byte (the earlier in the low four bits, as MXFP4
    and NVFP4 pack them) -> float32 [..., 2n], their values."""
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2)
    return _E2M1[codes.long()]


def packed_width(
    name: str, shape: tuple[int, int], packed_shape: list[int], widths: tuple[int, ...]
) -> int:
    """The width of codes packed densely along their rows: the one of ``widths`` (else of 2
    to 8) whose packing of a row of ``shape`` takes the words each row of ``packed_shape``
    has."""
    (rows, columns), (packed_rows, words) = shape, packed_shape
    fits = [b for b in widths or range(2, 9) if math.ceil(columns * b / 32) == words]
    if packed_rows != rows or len(fits) != 1:
        raise ValueError(
            f"{name}: [{packed_rows}, {words}] int32 does not pack {shape} weights of "
            f"{widths or 'a width of 2 to 8'} bits"
        )
    return fits[0]


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


class Codes(Protocol):
    """A quantized weight's codes: the [rows, columns] part of the [out, in] weight asked."""

    def read(self, rows: slice, columns: slice) -> torch.Tensor: ...


class DenseCodes:
    """FP8 or INT8 codes, one a byte, in the weight's layout."""

    def __init__(self, codes: Any) -> None:
        self.codes = codes

    def read(self, rows: slice, columns: slice) -> torch.Tensor:
        codes: torch.Tensor = self.codes[(rows, columns)]  # the checkpoint's (untyped) slice
        return codes


class PackedRows:
    """compressed-tensors' integers packed along each row, signed."""

    def __init__(self, packed: Any, bits: int, columns: int) -> None:
        self.packed, self.bits, self.columns = packed, bits, columns

    def read(self, rows: slice, columns: slice) -> torch.Tensor:
        return unpack_int32(self.packed[(rows,)], self.bits, self.columns)[:, columns]


class FP4Codes:
    """NVFP4's E2M1 codes, two a byte (the first in the low four bits), as their values."""

    def __init__(self, packed: Any, columns: int) -> None:
        self.packed, self.columns = packed, columns

    def read(self, rows: slice, columns: slice) -> torch.Tensor:
        packed: torch.Tensor = self.packed[(rows,)]
        return e2m1_values(packed)[:, columns]


class DequantizedWeight:
    """A quantized [rows, columns] weight as a `TensorSource` of float32 values."""

    def __init__(
        self,
        name: str,
        codes: Codes,
        shape: tuple[int, int],
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        quantization: CheckpointQuantization,
        column_groups: torch.Tensor | None = None,
    ) -> None:
        """``column_groups``: each column's group of scales, where it is not its place
        (GPTQ's activation order)."""
        self.name, self.codes, self.shape = name, codes, shape
        rows, columns = shape
        self.scale = _grid(scale.float(), rows)
        self.block = self._block(quantization)
        self.zero_point = None
        if zero_point is not None:
            self.zero_point = _grid(zero_point.float(), rows)
            if self.zero_point.shape != self.scale.shape:
                raise ValueError(
                    f"{name}: zero points {tuple(self.zero_point.shape)} do not match its "
                    f"scales {tuple(self.scale.shape)}"
                )
        # Whether each block of columns has its own scale in order (not GPTQ's activation order).
        self.in_order = column_groups is None
        if column_groups is None:
            column_groups = torch.arange(columns) // self.block[1]
        elif column_groups.shape != (columns,) or not bool(
            ((column_groups >= 0) & (column_groups < self.scale.shape[1])).all()
        ):
            raise ValueError(
                f"{name}: group indices {tuple(column_groups.shape)} do not give each of its "
                f"{columns} columns one of its {self.scale.shape[1]} groups"
            )
        self.column_groups = column_groups.long()

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
        values = self.codes.read(slice(r0, r1), slice(c0, c1)).float()
        # A row's own scales (a view), else its block's (gathered).
        scale_rows: slice | torch.Tensor = (
            slice(r0, r1) if self.block[0] == 1 else torch.arange(r0, r1) // self.block[0]
        )
        width = self.block[1]
        if self.in_order and c0 % width == 0 and (c1 - c0) % width == 0:
            # Whole blocks of columns: each block's scale broadcast over it, not gathered
            # for every value (several times faster).
            groups = slice(c0 // width, c0 // width + (c1 - c0) // width)
            blocks = values.unflatten(1, (-1, width))
            if self.zero_point is not None:
                blocks -= self.zero_point[scale_rows][:, groups, None]
            blocks *= self.scale[scale_rows][:, groups, None]
            return values
        scale_columns = self.column_groups[c0:c1]
        zero_point = self.zero_point
        if values.stride(1) == 1:
            _dequantize_(values, zero_point, self.scale, scale_rows, scale_columns)
        else:  # codes read down the columns (GPTQ's): gathered in that layout too
            zero_point = None if zero_point is None else zero_point.T
            _dequantize_(values.T, zero_point, self.scale.T, scale_columns, scale_rows)
        return values


def _dequantize_(
    values: torch.Tensor,
    zero_point: torch.Tensor | None,
    scale: torch.Tensor,
    rows: slice | torch.Tensor,
    columns: slice | torch.Tensor,
) -> None:
    """``values`` less their zero points, times their scales, in place: each value's the
    grid's at its (row, column) entry of ``rows`` and ``columns``."""
    if zero_point is not None:
        values -= zero_point[rows][:, columns]
    values *= scale[rows][:, columns]


def _grid(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A scale (or zero point) tensor as its 2-D grid over the weight: one value a tensor
    [1, 1], a row's [rows, 1]."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    return scale.reshape(rows, 1) if scale.dim() == 1 else scale
