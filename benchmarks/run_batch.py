"""`weir run-batch`'s path (each line through the HTTP API's app, in process) against
`LLM.generate`'s (the SDK), on one engine, alternating, the same requests each time.

    .venv/bin/python benchmarks/run_batch.py [--pairs 3 --num-prompts 128]

The requests are `weir bench throughput`'s random workload (token-id prompts of 33-256
tokens, 32-128 output tokens each, EOS ignored) as `/v1/completions` lines; prefix caching
is off so that every run does the same work. Prints each run's output tokens per second
and run-batch's time over `LLM.generate`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time

from weir.services.batch import answer_batch
from weir.services.bench.workload import (
    RandomWorkload,
    load_tokenizer,
    normal_vocab_ids,
    random_requests,
)
from weir.services.gateway.app import ApiOptions
from weir.services.gateway.chat_output import NO_PARSERS
from weir.services.llm import LLM
from weir.shared.model_store import resolve_model
from weir.shared.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=128)
    args = parser.parse_args()

    model_dir = resolve_model(None)
    requests = random_requests(
        RandomWorkload(args.num_prompts, 33, 256, 32, 128, seed=0),
        normal_vocab_ids(load_tokenizer(model_dir)),
    )
    output_tokens = sum(r.output_len for r in requests)
    lines = "".join(
        json.dumps(
            {
                "custom_id": str(i),
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "prompt": r.prompt_token_ids,
                    "max_tokens": r.output_len,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            }
        )
        + "\n"
        for i, r in enumerate(requests)
    ).encode()
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]

    with LLM(enable_prefix_caching=False) as llm:
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
        address = llm.server_info["client_address"]
        times: dict[str, list[float]] = {"run-batch": [], "LLM.generate": []}
        for _ in range(args.pairs):
            output = io.StringIO()
            start = time.perf_counter()
            counts = asyncio.run(
                answer_batch(
                    [address],
                    None,
                    NO_PARSERS,
                    ApiOptions(),
                    io.BytesIO(lines),
                    output,
                    2 * len(requests),
                )
            )
            times["run-batch"].append(time.perf_counter() - start)
            assert counts.failed == 0, output.getvalue()[:2000]

            start = time.perf_counter()
            done = llm.generate(prompts, params, use_tqdm=False)
            times["LLM.generate"].append(time.perf_counter() - start)
            assert sum(len(c.token_ids) for c in done) == output_tokens

    print(f"{len(requests)} requests, {output_tokens} output tokens, {args.pairs} pairs")
    for name, runs in times.items():
        rates = ", ".join(f"{output_tokens / t:,.0f}" for t in runs)
        print(f"{name:>13}: median {statistics.median(runs):.2f} s; output tok/s per run: {rates}")
    ratio = statistics.median(times["run-batch"]) / statistics.median(times["LLM.generate"])
    print(f"run-batch / LLM.generate time (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
