"""What one client's legal request costs the scheduler's loop, or every co-batched step,
as the request grows: the costs that must not grow with what a client controls.

    .venv/bin/python benchmarks/client_controlled_costs.py

* stop strings: ms per token of the stop-string check at token 1k, 2k and 4k of one
  request's output, with 63 stops of 99 characters and one of 5,000 (which holds all the
  text back) over an output of '#' (the stops' near-misses);
* banned ids: ms per step to sample 4 rows, one of them under min_tokens with
  stop_token_ids naming every id of the 49,152-token vocabulary 20 times over, banned as
  the executor holds them;
* leaving client: s for ``finish_requests`` of one client's N queued requests,
  interleaved with another's N;
* one abort: ms for ``finish_requests`` of one queued request among 50,000;
* health: ms for the scheduler to decode and answer one ``health`` frame naming the
  most stream ids a frame may name.
"""

from __future__ import annotations

import argparse
import time

import msgpack
import numpy as np
import torch

from weir.services.engine import frontend
from weir.services.executor.input_batch import InputBatch
from weir.services.executor.sampler import Sampler, SamplingBatch
from weir.services.scheduler import Request, RequestStatus, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.model_store import resolve_model
from weir.shared.protocol import client as client_protocol
from weir.shared.protocol.step import NewRequest
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import IncrementalDetokenizer, Tokenizer


def stop_strings(tokenizer: Tokenizer) -> list[float]:
    stops = tuple("#" * 97 + chr(0x41 + i) + "#" for i in range(63)) + ("c" * 5000,)
    stream = frontend._Stream(
        "r", b"c", SamplingParams(stop=stops), [1], IncrementalDetokenizer(tokenizer, [1]), 0.0
    )
    token = tokenizer.encode("#")[-1:]
    unsent, seconds = "", []
    for _ in range(4000):
        start = time.perf_counter()
        unsent, _, _ = frontend.ClientFrontend._add_until_stop(stream, unsent, token)
        seconds.append(time.perf_counter() - start)
    # The mean of the 100 tokens before each mark.
    return [sum(seconds[n - 100 : n]) / 100 * 1000 for n in (1000, 2000, 4000)]


def banned_ids(vocab: int = 49_152) -> float:
    batch = InputBatch(max_model_len=64, block_size=16, capacity=4, eos_token_ids=(2,))
    ids = list(range(vocab)) * 20  # every id, each 20 times: a legal request's list
    params = SamplingParams(min_tokens=8, stop_token_ids=ids)
    batch._add(NewRequest("r", [1, 2, 3], params, [0], 0))
    held = batch.stop_ids[batch.slot_of["r"]]  # what every step bans while under min_tokens
    sampler, logits = Sampler(seed=0), torch.randn(4, vocab)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        sampling = SamplingBatch.build(
            np.zeros(4),
            np.zeros(4, dtype=np.int64),
            np.ones(4),
            np.zeros(4),
            device="cpu",
            banned=[(0, held)],
        )
        sampler(logits, sampling)
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def leaving_client(n: int) -> float:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_model_len=8192),
        CacheConfig(block_size=16, num_blocks=4096),
    )
    params = SamplingParams(max_tokens=16)
    for i in range(n):
        scheduler.add_request(Request(f"a{i}", [1, 2, 3, 4], params))
        scheduler.add_request(Request(f"b{i}", [1, 2, 3, 4], params))
    start = time.perf_counter()
    scheduler.finish_requests([f"a{i}" for i in range(n)], RequestStatus.FINISHED_ABORTED)
    return time.perf_counter() - start


def one_abort(n: int, policy: str) -> float:
    """ms for ``finish_requests`` of one queued request (a client disconnecting), the
    mean over 200 spread through a queue of ``n``."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_model_len=8192, policy=policy),
        CacheConfig(block_size=16, num_blocks=4096),
    )
    params = SamplingParams(max_tokens=16)
    for i in range(n):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3, 4], params, priority=-(i % 3)))
    victims = [f"r{i}" for i in range(n // 400, n, n // 200)]
    start = time.perf_counter()
    for rid in victims:
        scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    return (time.perf_counter() - start) / len(victims) * 1000


def health(n: int) -> float:
    ids = [f"request-{i:08d}" for i in range(n)]
    frame = msgpack.packb(
        {
            "v": client_protocol.PROTOCOL_VERSION,
            "type": "health",
            "request_id": "h",
            "stream_ids": ids,
        }
    )
    start = time.perf_counter()
    msg = client_protocol.decode_client_message(frame)
    known: dict[str, None] = {}
    lost = [rid for rid in msg.stream_ids if rid not in known]
    client_protocol.encode_server_message(
        client_protocol.HealthReply("h", {"status": "ok", "lost_request_ids": lost})
    )
    return (time.perf_counter() - start) * 1000


def main() -> None:
    tokenizer = Tokenizer.from_model_dir(resolve_model(None))
    t1, t2, t4 = stop_strings(tokenizer)
    print("| cost | measured |\n|---|---:|")
    print(f"| stop strings, ms per token at token 1k / 2k / 4k | {t1:.3f} / {t2:.3f} / {t4:.3f} |")
    print(f"| stop_token_ids of 983,040 ids, ms per sampling step | {banned_ids():.2f} |")
    for n in (10_000, 20_000):
        print(f"| a client leaving with {n:,} of {2 * n:,} queued, s | {leaving_client(n):.3f} |")
    for policy in ("fcfs", "priority"):
        print(
            f"| one queued request aborted at 50,000 waiting ({policy}), ms | "
            f"{one_abort(50_000, policy):.3f} |"
        )
    n = getattr(client_protocol, "MAX_HEALTH_STREAM_IDS", client_protocol.MAX_ARRAY_LEN)
    print(f"| one health frame naming {n:,} streams, ms | {health(n):.1f} |")


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
