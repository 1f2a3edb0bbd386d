"""Beam search on the default model: `LLM.beam_search` (vLLM's algorithm over the engine's
one-token requests, every prompt's search at once) against transformers' `generate(num_beams=...)`
one prompt after another, in the same run, on the same CPU threads. Both search WIDTH beams for
TOKENS tokens, no end-of-sequence token in play, so they find the same beams (checked).
Reported: each side's wall time and output tokens (beams x tokens) per second.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/beam_search.py [--prompts 8 --width 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from weir.services import LLM
from weir.shared.beam_search import BeamSearchParams
from weir.shared.model_store import resolve_model

STARTS = [
    "The capital of France is",
    "Once upon a time, in a quiet village,",
    "The three laws of motion are",
    "To bake bread at home, first",
    "The history of the printing press",
    "A good night's sleep helps",
    "The largest planet in the solar system",
    "In mathematics, a prime number",
]


def transformers_beams(
    model_dir: str, prompts: list[str], width: int, tokens: int
) -> tuple[list[list[list[int]]], float]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = transformers.GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    beams = []
    start = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt).input_ids
            out = model.generate(torch.tensor([ids]), generation_config=config)
            beams.append([row[len(ids) :].tolist() for row in out])
    return beams, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = str(resolve_model(None))
    prompts = [STARTS[i % len(STARTS)] for i in range(args.prompts)]
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)
    with LLM(model_dir, max_model_len=512, device="cpu") as llm:
        llm.beam_search(prompts[:1], params)  # warm
        start = time.perf_counter()
        outputs = llm.beam_search(prompts, params)
        weir_s = time.perf_counter() - start
    want, hf_s = transformers_beams(model_dir, prompts, args.width, args.tokens)
    same = [[s.output_token_ids for s in out.sequences] for out in outputs] == want
    total = args.prompts * args.width * args.tokens
    print(f"{args.prompts} prompts x {args.width} beams x {args.tokens} tokens; same beams: {same}")
    print(f"{'':<14} {'seconds':>8} {'beam tok/s':>11}")
    print(f"{'weir':<14} {weir_s:>8.2f} {total / weir_s:>11.1f}")
    print(f"{'transformers':<14} {hf_s:>8.2f} {total / hf_s:>11.1f}  ({hf_s / weir_s:.2f}x weir)")


if __name__ == "__main__":
    main()
