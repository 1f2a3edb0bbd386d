"""bitsandbytes' checkpoints (transformers' ``load_in_4bit`` and ``load_in_8bit`` models
saved as they are, Unsloth's ``-bnb-4bit`` releases) read as their weights.

- 4-bit (NF4 or FP4): ``X.weight`` uint8 [out x in / 2, 1], the row-major weight's codes two
  a byte (the first in the high four bits), each an index into ``X.weight.quant_map`` [16];
  one scale per block of ``blocksize`` consecutive values (``X.weight.absmax``), or, doubly
  quantized, uint8 codes of the scales into ``nested_quant_map`` [256], times one
  ``nested_absmax`` per ``nested_blocksize`` of them, plus ``nested_offset``. The quant
  state's JSON (``X.weight.quant_state.bitsandbytes__nf4``, a uint8 tensor of its text)
  gives the shape and the block sizes. A row of ``in`` values is whole blocks, so a block's
  scale is a group's of one row (`DequantizedWeight`).
- 8-bit (LLM.int8()): ``X.weight`` int8 [out, in], ``X.SCB`` [out] each row's largest
  magnitude: a weight is code x SCB / 127.
"""

import json
import math
from typing import Any

import torch

from weir.services.executor.dequantized_weight import DenseCodes, DequantizedWeight
from weir.shared.checkpoint_quantization import CheckpointQuantization

_QUANT_STATES = (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")
# A quantized module's tensors besides its codes: read with them, not loaded on their own.
BNB_PARTS: tuple[str, ...] = (
    ".absmax",
    ".quant_map",
    ".nested_absmax",
    ".nested_quant_map",
    ".SCB",
)
BNB_PARTS += (".weight_format", *_QUANT_STATES)


class FourBitCodes:
    """A 4-bit weight's codes as the values of its quant map, read as [out, in]."""

    def __init__(self, packed: Any, quant_map: torch.Tensor, columns: int) -> None:
        self.packed, self.quant_map, self.columns = packed, quant_map.float(), columns

    def read(self, rows: slice, columns: slice) -> torch.Tensor:
        # A row holds an even number of codes (whole blocks): its bytes are its own.
        half = self.columns // 2
        packed: torch.Tensor = self.packed[(slice(rows.start * half, rows.stop * half),)]
        codes = torch.stack([packed >> 4, packed & 15], -1).reshape(-1, self.columns)
        return self.quant_map[codes[:, columns].long()]


def bnb_weight(
    name: str, where: dict[str, Any], quantization: CheckpointQuantization
) -> DequantizedWeight | None:
    """The weight of a bitsandbytes module whose codes are ``name`` (None for any other
    tensor), its parts checked against each other (ValueError names the tensor)."""
    if not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    state = next((name + s for s in _QUANT_STATES if name + s in where), None)
    if state is not None:
        return _four_bit(name, state, where, quantization)
    if f"{module}.SCB" in where:
        return _eight_bit(name, where, quantization)
    return None


def _tensor(where: dict[str, Any], name: str) -> torch.Tensor:
    tensor: torch.Tensor = where[name].get_tensor(name)
    return tensor


def _four_bit(
    name: str, state_name: str, where: dict[str, Any], quantization: CheckpointQuantization
) -> DequantizedWeight:
    try:
        state = json.loads(bytes(_tensor(where, state_name).tolist()))
        rows, columns = (int(n) for n in state["shape"])
        blocksize = int(state["blocksize"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{state_name}: not a 4-bit quant state's JSON ({exc})") from None
    packed = where[name].get_slice(name)
    if packed.get_dtype() != "U8" or math.prod(packed.get_shape()) * 2 != rows * columns:
        raise ValueError(
            f"{name}: {packed.get_dtype()} {packed.get_shape()} does not hold the "
            f"{rows} x {columns} 4-bit codes its quant state names (uint8, two a byte)"
        )
    if f"{name}.absmax" not in where or f"{name}.quant_map" not in where:
        raise ValueError(f"{name}: the checkpoint has no {name}.absmax and {name}.quant_map")
    if columns % blocksize:
        raise ValueError(
            f"{name}: rows of {columns} values are not whole blocks of {blocksize}: such a "
            "checkpoint is not read"
        )
    absmax = _tensor(where, f"{name}.absmax")
    if "nested_blocksize" in state:
        nested = int(state["nested_blocksize"])
        codes = _tensor(where, f"{name}.nested_quant_map").float()[absmax.long()]
        block_max = _tensor(where, f"{name}.nested_absmax").float()
        block_max = block_max.repeat_interleave(nested)[: absmax.numel()]
        absmax = codes * block_max + float(state["nested_offset"])
    if absmax.numel() != rows * columns // blocksize:
        raise ValueError(
            f"{name}.absmax: {absmax.numel()} scales for {rows} x {columns} values in blocks "
            f"of {blocksize}"
        )
    quant_map = _tensor(where, f"{name}.quant_map")
    if quant_map.numel() != 16:
        raise ValueError(f"{name}.quant_map: {quant_map.numel()} values, not 16")
    reader = FourBitCodes(packed, quant_map, columns)
    scale = absmax.float().reshape(rows, columns // blocksize)
    return DequantizedWeight(name, reader, (rows, columns), scale, None, quantization)


def _eight_bit(
    name: str, where: dict[str, Any], quantization: CheckpointQuantization
) -> DequantizedWeight:
    codes = where[name].get_slice(name)
    scb = _tensor(where, f"{name.removesuffix('.weight')}.SCB").float()
    shape = codes.get_shape()
    if codes.get_dtype() != "I8" or len(shape) != 2 or scb.shape != (shape[0],):
        raise ValueError(
            f"{name}: {codes.get_dtype()} {shape} with {tuple(scb.shape)} SCB is not 8-bit "
            "codes and each row's scale"
        )
    rows, columns = shape
    return DequantizedWeight(
        name, DenseCodes(codes), (rows, columns), scb / 127, None, quantization
    )
