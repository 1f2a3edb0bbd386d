"""Prompts sharing a long system prompt that arrive together, behind a long prefill.

Starts ``weir serve`` on the default model, sends one unrelated ~1,500-token completion,
then, 50 ms later, N completions that share a ~770-token system prompt (each its own
question), all at once over HTTP; reports the wall time, the prompt tokens the engine
computed (``weir_iteration_tokens``' sum, the decodes included) and the prefix cache's hit
tokens. Before pending blocks (docs/architecture.md, "Prefix cache"), the burst's
requests that one step admitted together each computed the shared prompt.

    .venv/bin/python benchmarks/prefix_burst.py [--num-prompts 16] [--port 31590]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import urllib.request

import httpx

METRICS = ("weir_prefix_cache_hit_tokens_total", "weir_iteration_tokens_sum")


def _metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


async def _burst(base: str, num_prompts: int) -> float:
    system = " ".join(f"Rule {i}: answer briefly and politely, citing sources." for i in range(60))
    busy = " ".join(f"Unrelated sentence number {i} about the weather." for i in range(150))
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: str) -> None:
            body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
            reply = await client.post(base + "/v1/completions", json=body)
            reply.raise_for_status()

        start = time.perf_counter()
        long = asyncio.create_task(one(busy))
        await asyncio.sleep(0.05)
        questions = [f"{system}\nQuestion {q}: what is {q} plus {q}?" for q in range(num_prompts)]
        await asyncio.gather(*(one(q) for q in questions))
        await long
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--port", type=int, default=31590, help="HTTP; the next three too")
    args = parser.parse_args()
    port = args.port
    ports = ["--http-port", str(port), "--port", str(port + 1), "--metrics-port", str(port + 2)]
    server = subprocess.Popen(
        [sys.executable, "-m", "weir.services.cli", "serve", *ports]
        + ["--executor-metrics-port", str(port + 3)],
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        stdout=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("weir serve did not start")
            time.sleep(0.5)
        seconds = asyncio.run(_burst(base, args.num_prompts))
        found = _metrics(f"http://127.0.0.1:{port + 2}/metrics")
        print(
            f"{args.num_prompts} prompts: {seconds:.2f} s, computed tokens "
            f"{found['weir_iteration_tokens_sum']:.0f}, prefix cache hit tokens "
            f"{found['weir_prefix_cache_hit_tokens_total']:.0f}"
        )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
