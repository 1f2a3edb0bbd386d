"""Write a GGUF's weights dequantized to F32, metadata unchanged: the llama-cpp baseline of
`weir bench throughput` on the very values Weir's float32 run computes with.

    .venv/bin/python benchmarks/gguf_to_f32.py ~/.cache/weir/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \\
        /tmp/SmolLM2-135M-Instruct.F32.gguf
    weir bench throughput --baseline llama-cpp --llama-cpp-gguf /tmp/SmolLM2-135M-Instruct.F32.gguf

Dequantization is gguf's own (the one Weir's converter uses), so the F32 file holds exactly
the weights Weir loads from the quantized one.
"""

import argparse
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

_ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32
_WRITTEN_BY_WRITER = ("general.architecture", "general.file_type")


def write_f32(source: Path, target: Path) -> None:
    reader = GGUFReader(source)
    writer = GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in _WRITTEN_BY_WRITER:
            continue  # the header fields the writer makes itself
        kind = field.types[0]
        item_kind = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=item_kind)
    writer.add_file_type(_ALL_F32)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a .gguf file (any quantization)")
    parser.add_argument("target", type=Path, help="the F32 .gguf to write")
    args = parser.parse_args()
    write_f32(args.source, args.target)
    print(args.target)


if __name__ == "__main__":
    main()
