"""GPTQ's and AutoAWQ's quantized linear layers read as their [out, in] weights.

Both store a layer's weight transposed, as unsigned ``b``-bit codes of its [in, out] layout
packed into int32 words, with a scale and a zero point for each group of input rows and
output column (``scales`` [groups, out], ``qzeros`` [groups, out] packed along the outputs):

- GPTQ (AutoGPTQ, GPTQModel): ``qweight`` [in x b / 32, out], each output column's codes
  packed down the input rows as one little-endian bit stream (32 / b rows a word where b
  divides 32; 3-bit codes cross words); ``qzeros`` packed the same way along each group's
  outputs; ``g_idx`` [in], each input row's group (with ``desc_act``, the activation order
  GPTQ quantized in; else row // group_size). Its v1 checkpoints store each zero point less
  one (`CheckpointQuantization.zero_point_offset`), added back per code as vLLM's kernels do.
- AWQ (AutoAWQ's GEMM layout): ``qweight`` [in, out / 8], eight output columns a word,
  interleaved: the word's k-th code is column ``AWQ_ORDER[k]`` of the eight; ``qzeros``
  [groups, out / 8] the same; without zero points (``zero_point: false``) every zero point
  is 8.

A weight is then (code - zero[group of its input row]) x scale[group of its input row].
"""

import math
from typing import Any

import torch

from weir.services.executor.dequantized_weight import DequantizedWeight, unpack_int32
from weir.shared.checkpoint_quantization import CheckpointQuantization

# A packed module's tensors besides its codes: read with them, not loaded on their own.
PACKED_LINEAR_PARTS = (".qzeros", ".scales", ".g_idx")
# The output column of the eight in an AWQ word that each of its codes (lowest bits first) is.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The code of a word that each of its eight output columns is.
_AWQ_CODE_OF_COLUMN = tuple(AWQ_ORDER.index(column) for column in range(8))


def _unsigned(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[n, words] int32 of ``bits``-bit codes packed along each row -> [n, count] unsigned."""
    return unpack_int32(packed, bits, count) + (1 << (bits - 1))


class GPTQCodes:
    """GPTQ's ``qweight``: codes packed down the input rows, read as [out, in]."""

    def __init__(self, qweight: Any, bits: int, inputs: int) -> None:
        self.qweight, self.bits, self.inputs = qweight, bits, inputs

    def read(self, rows: slice, columns: slice) -> torch.Tensor:
        if 32 % self.bits == 0:  # whole codes in each word: shifted out along the inputs
            per = 32 // self.bits
            first = columns.start // per
            words: torch.Tensor = self.qweight[(slice(first, math.ceil(columns.stop / per)), rows)]
            shifts = torch.arange(0, 32, self.bits, dtype=torch.int32).view(1, -1, 1)
            codes = ((words.unsqueeze(1) >> shifts) & ((1 << self.bits) - 1)).flatten(0, 1)
            return codes[columns.start - first * per : columns.stop - first * per].T
        # 32 codes fill ``bits`` words exactly: read from the 32-code run the slice starts in.
        first = columns.start // 32 * 32
        end = min(math.ceil(columns.stop / 32) * 32, self.inputs)
        words = self.qweight[
            (slice(first // 32 * self.bits, math.ceil(end * self.bits / 32)), rows)
        ]
        codes = _unsigned(words.T, self.bits, end - first)
        return codes[:, columns.start - first : columns.stop - first]


class AWQCodes:
    """AWQ's ``qweight``: eight interleaved output columns a word, read as [out, in]."""

    def __init__(self, qweight: Any) -> None:
        self.qweight = qweight

    def read(self, rows: slice, columns: slice) -> torch.Tensor:
        first = rows.start // 8 * 8
        words = self.qweight[(columns, slice(first // 8, math.ceil(rows.stop / 8)))]
        codes = _awq_columns(words)
        return codes[:, rows.start - first : rows.stop - first].T


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """[n, words] AWQ words -> [n, 8 x words] unsigned codes in their columns' order: each
    column shifted out of its code's place."""
    shifts = torch.tensor([4 * code for code in _AWQ_CODE_OF_COLUMN], dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 15).flatten(1)


def packed_linear_weight(
    name: str, where: dict[str, Any], quantization: CheckpointQuantization
) -> DequantizedWeight | None:
    """The weight of a GPTQ or AWQ module whose ``qweight`` is ``name`` (None for any other
    tensor), its parts checked against each other and config.json (ValueError names the
    tensor)."""
    module, _, kind = name.rpartition(".")
    if kind != "qweight":
        return None

    def part(kind: str) -> torch.Tensor | None:
        part_name = f"{module}.{kind}"
        return where[part_name].get_tensor(part_name) if part_name in where else None

    qweight = where[name].get_slice(name)
    dtype, shape = qweight.get_dtype(), qweight.get_shape()
    scales, qzeros, g_idx = part("scales"), part("qzeros"), part("g_idx")
    if dtype != "I32" or len(shape) != 2:
        raise ValueError(f"{name}: {dtype} {shape} is not int32 codes [words, columns]")
    if scales is None or not scales.is_floating_point() or scales.dim() != 2:
        raise ValueError(f"{name}: the checkpoint has no floating-point 2-D {module}.scales")
    groups, outputs = scales.shape
    if quantization.method == "awq":
        codes: GPTQCodes | AWQCodes = AWQCodes(qweight)
        inputs, bits = shape[0], 4
        if shape[1] * 8 != outputs:
            raise ValueError(f"{name}: {shape} does not pack the {outputs} columns of its scales")
    else:
        widths = quantization.num_bits
        if g_idx is not None and (g_idx.is_floating_point() or g_idx.dim() != 1):
            raise ValueError(
                f"{module}.g_idx: {g_idx.dtype} {tuple(g_idx.shape)} is no 1-D integer tensor"
            )
        if g_idx is None and len(widths) > 1:
            raise ValueError(
                f"{name}: without {module}.g_idx its input rows are unknown (codes of "
                f"{' or '.join(map(str, widths))} bits)"
            )
        inputs = g_idx.numel() if g_idx is not None else shape[0] * 32 // widths[0]
        bits = _gptq_width(name, shape, inputs, outputs, widths)
        codes = GPTQCodes(qweight, bits, inputs)
    if qzeros is None:
        if quantization.method == "gptq" or quantization.asymmetric:
            raise ValueError(f"{name}: the checkpoint has no {module}.qzeros")
        zeros = torch.full((groups, outputs), 1 << (bits - 1))
    elif qzeros.dtype != torch.int32 or qzeros.shape != (groups, math.ceil(outputs * bits / 32)):
        raise ValueError(
            f"{module}.qzeros: {qzeros.dtype} {tuple(qzeros.shape)} does not pack the "
            f"{groups} x {outputs} zero points of its scales"
        )
    elif quantization.method == "awq":
        zeros = _awq_columns(qzeros)
    else:
        zeros = _unsigned(qzeros, bits, outputs) + quantization.zero_point_offset
    if g_idx is not None and torch.equal(g_idx, _in_order(inputs, groups)):
        g_idx = None  # as GPTQ without desc_act writes it: its groups in order
    return DequantizedWeight(
        f"{module}.weight", codes, (outputs, inputs), scales.T, zeros.T, quantization, g_idx
    )


def _in_order(inputs: int, groups: int) -> torch.Tensor:
    """Each input row's group where the groups take the rows in order."""
    return torch.arange(inputs) // math.ceil(inputs / groups)


def _gptq_width(
    name: str, shape: list[int], inputs: int, outputs: int, widths: tuple[int, ...]
) -> int:
    """The width of a GPTQ weight's codes: the one of config.json's whose packing of its
    input rows takes the rows ``qweight`` has."""
    fits = [b for b in widths if math.ceil(inputs * b / 32) == shape[0]]
    if shape[1] != outputs or len(fits) != 1:
        raise ValueError(
            f"{name}: {shape} int32 does not pack {inputs} x {outputs} codes of "
            f"{' or '.join(map(str, widths))} bits"
        )
    return fits[0]
