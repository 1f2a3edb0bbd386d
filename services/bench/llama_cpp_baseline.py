"""llama.cpp baseline for `bench throughput`: llama-cpp-python's batched decoding on the GGUF
file Weir loads, with the same token ids and output lengths and the same thread count.

Every request is its own sequence in one context whose unified KV cache holds them all.
Prompts are prefilled in batches of up to ``n_batch`` tokens (several prompts per batch,
a long one split across two), logits only at each prompt's last token; then every
unfinished sequence decodes one token per ``llama_decode`` until it has its output_len
(greedy argmax, EOS ignored). Timing starts after one short warmup request, as for Weir.

llama-cpp-python is optional: ``pip install llama-cpp-python`` (PyPI ships it as source
for Linux, so pip builds llama.cpp with the machine's compiler and cmake: about a quarter
of an hour on two cores). Without it the baseline is skipped with that message.
"""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from weir.services.bench.report import EngineRun
from weir.services.bench.workload import WARMUP_PROMPT, BenchRequest

NAME = "llama-cpp"
INSTALL_HINT = (
    "pip install llama-cpp-python (PyPI has only its source for Linux: pip builds "
    "llama.cpp, which needs cmake and a C++ compiler and takes minutes)"
)


def missing_reason(gguf: Path | None) -> str | None:
    """Why the baseline cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama_cpp is not installed; to run it: {INSTALL_HINT}"
    if gguf is None:
        return "it needs a .gguf file: pass --model FILE.gguf or --llama-cpp-gguf FILE.gguf"
    if not gguf.is_file():
        return f"{gguf} is not a file"
    return None


class _Engine:
    """One llama.cpp model and context sized for ``num_seqs`` sequences of ``n_ctx`` tokens in
    all, through the C API (the high-level ``Llama`` class decodes one sequence at a time)."""

    def __init__(self, gguf: Path, n_ctx: int, num_seqs: int, threads: int, n_batch: int) -> None:
        import llama_cpp as lc

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load chatter
        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(
            str(gguf).encode(), lc.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_seq_max = num_seqs
        # One KV buffer for all sequences: without it each gets n_ctx / n_seq_max positions.
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(
                f"llama.cpp could not make a context of {n_ctx} tokens for {num_seqs} sequences"
            )
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run one batch of (token, position, sequence, wants logits); returns the greedy next
        token of each entry that wanted logits, in batch order."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")
        out = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                row: Any = self.lc.llama_get_logits_ith(self.ctx, i)
                view = np.ctypeslib.as_array(
                    ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab_size,)
                )
                out.append(int(view.argmax()))
        return out


def _generate(engine: _Engine, requests: list[BenchRequest]) -> list[list[int]]:
    """Greedy outputs of ``requests`` (sequence i is request i); the KV cache starts empty."""
    outputs: list[list[int]] = [[] for _ in requests]
    # Prefill: prompt tokens in order, packed into batches of n_batch.
    pending: list[tuple[int, int, int, bool]] = []
    for seq, r in enumerate(requests):
        last = len(r.prompt_token_ids) - 1
        pending += [(t, pos, seq, pos == last) for pos, t in enumerate(r.prompt_token_ids)]
    for start in range(0, len(pending), engine.n_batch):
        chunk = pending[start : start + engine.n_batch]
        sampled = engine.decode(chunk)
        for (_, _, seq, _), token in zip([e for e in chunk if e[3]], sampled):
            outputs[seq].append(token)
    # Decode: every unfinished sequence advances one token per step.
    while True:
        live = [seq for seq, r in enumerate(requests) if len(outputs[seq]) < r.output_len]
        if not live:
            return outputs
        for begin in range(0, len(live), engine.n_batch):
            seqs = live[begin : begin + engine.n_batch]
            entries = [
                (
                    outputs[seq][-1],
                    len(requests[seq].prompt_token_ids) + len(outputs[seq]) - 1,
                    seq,
                    True,
                )
                for seq in seqs
            ]
            for seq, token in zip(seqs, engine.decode(entries)):
                outputs[seq].append(token)


def run_llama_cpp(
    gguf: Path, requests: list[BenchRequest], threads: int, n_batch: int = 2048
) -> EngineRun:
    warmup = [BenchRequest(list(WARMUP_PROMPT), 2)]
    n_ctx = sum(len(r.prompt_token_ids) + r.output_len for r in requests)
    engine = _Engine(gguf, n_ctx, len(requests), threads, n_batch)
    try:
        _generate(engine, warmup)
        engine.clear()
        start = time.perf_counter()
        outputs = _generate(engine, requests)
        wall = time.perf_counter() - start
    finally:
        engine.close()
    return EngineRun.from_outputs(
        NAME,
        requests,
        [len(o) for o in outputs],
        wall,
        f"llama-cpp-python batched decoding, {gguf.name}, n_batch {n_batch}, {threads} threads",
    )
