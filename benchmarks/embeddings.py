"""Embedding throughput: Weir's pooling runner (``LLM(runner="pooling").embed``) against
transformers on the same weights, measured in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/embeddings.py [--num-prompts 256]

Prompts of 16 to 256 tokens (random ids of the default model's vocabulary, seeded). Weir
gets them all at once (continuous batching, chunked prefill, LAST pooling, normalized);
transformers (``AutoModel``, float32, the same thread count) embeds them in batches of
``--hf-batch`` sorted by length (right padding, the last real token's state, normalized),
as a sentence-transformers loop does. Reports prompts/s and prompt tokens/s of each, their
ratio, and the largest difference between the two sides' vectors.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from weir.services import LLM
from weir.shared.model_store import resolve_model


def _prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))] for _ in range(num)]


def _hf(model_dir: str, prompts: list[list[int]], batch: int) -> tuple[float, np.ndarray]:
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = np.zeros((len(prompts), model.config.hidden_size), dtype=np.float32)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(order), batch):
            rows = order[first : first + batch]
            longest = max(len(prompts[i]) for i in rows)
            ids = torch.zeros((len(rows), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, : len(prompts[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(rows)), mask.sum(1) - 1]
            out[rows] = torch.nn.functional.normalize(last, dim=-1).numpy()
    return time.perf_counter() - start, out


def _weir(model_dir: str, prompts: list[list[int]], threads: int) -> tuple[float, np.ndarray]:
    with LLM(model_dir, runner="pooling", device="cpu", threads=threads) as llm:
        llm.embed(prompts[:4])  # warm up
        start = time.perf_counter()
        outputs = llm.embed(prompts)
        elapsed = time.perf_counter() - start
    return elapsed, np.array([out.embedding for out in outputs], dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(None))
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = _prompts(args.num_prompts, vocab, args.seed)
    num_tokens = sum(map(len, prompts))
    weir_s, weir_vectors = _weir(model_dir, prompts, args.threads)
    hf_s, hf_vectors = _hf(model_dir, prompts, args.hf_batch)
    print(f"{args.num_prompts} prompts, {num_tokens} tokens, {args.threads} threads")
    print("| engine | s | prompts/s | prompt tokens/s |")
    print("|---|---:|---:|---:|")
    for name, seconds in (("Weir", weir_s), (f"transformers (batch {args.hf_batch})", hf_s)):
        rate = args.num_prompts / seconds
        print(f"| {name} | {seconds:.2f} | {rate:.1f} | {num_tokens / seconds:,.0f} |")
    print(f"Weir / transformers: {hf_s / weir_s:.2f}x")
    print(f"largest difference between the vectors: {np.abs(weir_vectors - hf_vectors).max():.2e}")


if __name__ == "__main__":
    main()
