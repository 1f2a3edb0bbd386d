"""Data parallelism (`weir serve --data-parallel-size N`): N engines behind one gateway,
each supervised on its own, through the official openai client."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import openai
import pytest
from serving_helpers import greedy_completion, hf_greedy, metric, raw_dealer, read_metrics

from weir.services.launcher import ServerProcesses
from weir.shared.config import EngineArgs


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_two_tensor_parallel_replicas_share_the_traffic_and_restart_apart(
    tiny_model_dir, tiny_hf_model, capfd
):
    """Two engines of two ranks each: the router spreads concurrent requests over both,
    every answer is transformers' greedy one, and a rank killed in replica 1 takes down its
    own group only (replica 0's ranks keep their processes) while requests go on; the
    log lines of the loss say which replica lost it."""
    engine = EngineArgs(
        model=str(tiny_model_dir),
        device="cpu",
        tensor_parallel_size=2,
        max_num_batched_tokens=32,
        kv_cache_memory="1MiB",
        served_model_name="tiny",
        block_size=4,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
        },
    )
    prompts = [[5 + i, 6, 7, 8 + i, 9] for i in range(8)]
    with ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, http_port=0, data_parallel_size=2
    ) as processes:
        info = processes.info
        replicas = info["replicas"]
        assert len({r["client_address"] for r in replicas}) == 2
        assert [len(r["executors"]) for r in replicas] == [2, 2]
        client = openai.OpenAI(base_url=info["http_address"] + "/v1", api_key="x")

        def complete(prompt: list[int]) -> list[int]:
            return greedy_completion(client, "tiny", prompt, 12)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, prompts)) == [
                hf_greedy(tiny_hf_model, p, 12) for p in prompts
            ]
        served = [
            metric(read_metrics(r["metrics_address"]), "weir_requests_finished_total")
            for r in replicas
        ]
        assert sum(served) == 8 and min(served) > 0, served
        # The API port's /metrics carries each replica's series, told apart by engine=i.
        on_api_port = read_metrics(info["http_address"] + "/metrics").items()
        finished = 'weir_requests_finished_total{{engine="{}",'
        assert [
            sum(v for k, v in on_api_port if k.startswith(finished.format(i))) for i in (0, 1)
        ] == served

        pids = {c.name: c.proc.pid for c in processes._children if c.role == "executor"}
        os.kill(pids["executor 1 of replica 1"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(pids["executor 0 of replica 1"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pids["executor 0 of replica 1"])  # its group went with it
        assert _alive(pids["executor 0 of replica 0"]) and _alive(pids["executor 1 of replica 0"])
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts[:4])) == [
                hf_greedy(tiny_hf_model, p, 12) for p in prompts[:4]
            ]
        # Each replica publishes its own cache's events, vLLM's data_parallel_rank its index;
        # replica 1's new group comes with an empty cache, and says so.
        for i, replica in enumerate(replicas):
            batches = _kv_events(replica["kv_events_replay_address"])
            assert batches and {rank for _, _, rank in batches} == {i}
        assert not _cleared(_kv_events(replicas[0]["kv_events_replay_address"]))
        while not _cleared(_kv_events(replicas[1]["kv_events_replay_address"])):
            assert time.monotonic() < deadline + 60, "replica 1 never said its cache was new"
            time.sleep(0.2)
    logged = capfd.readouterr().err
    assert "[scheduler of replica 1] " in logged and "[scheduler] " not in logged, logged


def _kv_events(replay_address: str) -> list:
    """Every KV event batch a replica kept, through its replay socket."""
    with raw_dealer(replay_address) as dealer:
        dealer.send_multipart([b"", bytes(8)])
        batches = []
        while True:
            assert dealer.poll(10_000)
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append(msgpack.unpackb(payload))


def _cleared(batches: list) -> bool:
    return any(event[0] == "AllBlocksCleared" for _, events, _ in batches for event in events)


def test_each_replica_sees_its_own_gpus(monkeypatch):
    server = ServerProcesses(EngineArgs(tensor_parallel_size=2), data_parallel_size=2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert server._replica_env(1)["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert server._replica_env(0)["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert server._replica_env(1)["CUDA_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        ServerProcesses(EngineArgs(), data_parallel_size=0)
    ServerProcesses(EngineArgs(), data_parallel_size=3)  # the default ports stay apart
    with pytest.raises(ValueError, match="--port and --metrics-port both take port 8200"):
        ServerProcesses(EngineArgs(), port=8100, metrics_port=8200, data_parallel_size=2)
