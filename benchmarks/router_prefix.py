"""Prefix-cache hit rate behind the gateway's router: one engine replica, then two.

Workload: --groups system prompts of about 600 characters, each followed by
--questions short questions (all requests of a group share the system prompt),
sent --concurrency at a time in shuffled order through the official `openai`
client. The hit rate is the schedulers' prefix_cache_hits / prefix_cache_queries
(tokens) summed over replicas, read from their /metrics before and after.

    .venv/bin/python benchmarks/router_prefix.py [--groups 8 --questions 8]

The floor (issue 12): two replicas reach >= 90% of one replica's hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import urllib.request

import openai

from weir.services.launcher import GatewayProcess, ServerProcesses
from weir.shared.config import EngineArgs


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _prompts(groups: int, questions: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "river stone lantern orchard copper meadow signal harbor velvet ember".split()
    prompts = []
    for g in range(groups):
        system = f"System {g}: " + " ".join(rng.choice(words) for _ in range(90)) + ".\n"
        prompts += [
            system + f"Question {q}: what is {rng.randrange(1000)}?" for q in range(questions)
        ]
    rng.shuffle(prompts)
    return prompts


async def _send(base: str, prompts: list[str], concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        model = (await client.models.list()).data[0].id

        async def one(prompt: str) -> None:
            async with limit:
                await client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=2,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )

        await asyncio.gather(*(one(p) for p in prompts))


def measure(engine: EngineArgs, num_replicas: int, prompts: list[str], concurrency: int) -> dict:
    replicas = []
    try:
        for _ in range(num_replicas):
            replica = ServerProcesses(engine, port=0, metrics_port=0, executor_metrics_port=0)
            replica.start()
            replicas.append(replica)
        with GatewayProcess([r.client_address for r in replicas]) as gateway:
            base = gateway.info["http_address"]
            while urllib.request.urlopen(base + "/health", timeout=10).status != 200:
                time.sleep(0.2)
            urls = [r.info["metrics_address"] for r in replicas]
            before = [
                (
                    _counter(u, "weir_prefix_cache_hit_tokens_total"),
                    _counter(u, "weir_prefix_cache_query_tokens_total"),
                )
                for u in urls
            ]
            start = time.perf_counter()
            asyncio.run(_send(base, prompts, concurrency))
            seconds = time.perf_counter() - start
            after = [
                (
                    _counter(u, "weir_prefix_cache_hit_tokens_total"),
                    _counter(u, "weir_prefix_cache_query_tokens_total"),
                )
                for u in urls
            ]
    finally:
        for replica in replicas:
            replica.shutdown()
    hits = [a[0] - b[0] for a, b in zip(after, before)]
    queries = [a[1] - b[1] for a, b in zip(after, before)]
    return {
        "replicas": num_replicas,
        "hit_rate": sum(hits) / sum(queries),
        "hits": hits,
        "queries": queries,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine = EngineArgs(model=args.model, kv_cache_memory="64MiB", device="cpu")
    prompts = _prompts(args.groups, args.questions, args.seed)
    one = measure(engine, 1, prompts, args.concurrency)
    two = measure(engine, 2, prompts, args.concurrency)
    for result in (one, two):
        print(
            f"{result['replicas']} replica(s): prefix-cache hit rate {result['hit_rate']:.3f} "
            f"(hits {result['hits']}, queries {result['queries']}), {result['seconds']:.1f} s"
        )
    print(f"two replicas reach {two['hit_rate'] / one['hit_rate']:.1%} of one replica's hit rate")


if __name__ == "__main__":
    main()
