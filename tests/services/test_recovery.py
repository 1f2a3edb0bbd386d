"""Faults of whole processes: an executor SIGKILLed mid-run under `weir serve` loses no
request, and SIGTERM drains (in-flight requests finish, new ones are refused)."""

import asyncio
import os
import random
import re
import signal
import time

import pytest
from serving_helpers import hf_greedy, stop_the_replacement
from test_serving_processes import children_of, read_until, start_serve

from weir.services.launcher import ServerProcesses
from weir.shared.client import AsyncWeirClient, EngineError, ServerUnavailableError, WeirClient
from weir.shared.config import EngineArgs
from weir.shared.sampling import SamplingParams

NUM_TOKENS = 20
_rng = random.Random(21)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(_rng.randrange(4, 40))] for _ in range(20)]


def _wait_status(client: WeirClient, wanted: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = client.health()
        if health["status"] == wanted or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


@pytest.fixture(scope="module")
def references(tiny_hf_model) -> list[list[int]]:
    """transformers' greedy outputs of PROMPTS."""
    return [hf_greedy(tiny_hf_model, prompt, NUM_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_an_executor_killed_mid_run_under_serve_loses_no_request(tiny_model_dir, references, stop):
    """Killed, or hung (stopped: the scheduler gives it up after --executor-timeout and
    `weir serve` kills it, or it would never be replaced), the executor is started again
    and every request finishes as transformers decodes it."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    engine_args = EngineArgs(
        model=str(tiny_model_dir),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cpu",
        executor_timeout=2.0,
    )
    with ServerProcesses(engine_args, port=0, metrics_port=0, executor_metrics_port=0) as server:
        executor_pid = server.info["executors"][0]["pid"]
        executor = next(c for c in server._children if c.proc.pid == executor_pid)

        async def run() -> tuple[list[list[int]], bool]:
            async with AsyncWeirClient(server.client_address, timeout=120) as client:
                produced: list[list[int]] = [[] for _ in PROMPTS]
                unfinished = 0

                async def one(i: int) -> None:
                    nonlocal unfinished
                    async for out in client.generate(PROMPTS[i], params):
                        produced[i] += out.new_token_ids
                        # Killed right here, not after a wake-up that a busy loop may delay.
                        if not unfinished and sum(map(len, produced)) >= 60:
                            os.kill(executor_pid, stop)
                            unfinished = sum(len(p) < NUM_TOKENS for p in produced)

                await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
                return produced, unfinished

        produced, unfinished = asyncio.run(run())
        assert unfinished >= 10, "the executor must die with most requests in flight"
        assert produced == references
        with WeirClient(server.client_address) as client:
            health = _wait_status(client, "ok")
            assert health["status"] == "ok" and health["num_streams"] == 0
            assert health["num_free_blocks"] == health["num_blocks"]
        assert any(c.name == "executor 0" and c.proc.pid != executor_pid for c in server._children)
        assert executor.proc.returncode == -signal.SIGKILL


def test_requests_of_a_lost_executor_fail_clearly_when_none_comes_back(tiny_model_dir):
    engine_args = EngineArgs(
        model=str(tiny_model_dir), device="cpu", recovery_timeout=1.0, executor_timeout=2.0
    )
    with ServerProcesses(engine_args, port=0, metrics_port=0, executor_metrics_port=0) as server:
        executor = next(c for c in server._children if c.name == "executor 0")
        with WeirClient(server.client_address, timeout=60) as client:
            stream = client.generate(
                [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
            )
            next(stream)
            # Silent: the scheduler gives it up and `weir serve` kills it; the executor it
            # starts instead is held before it joins, so none comes back.
            os.kill(executor.proc.pid, signal.SIGSTOP)
            new = stop_the_replacement(server, executor.proc.pid)
            try:
                assert _wait_status(client, "recovering", 30)["status"] == "recovering"
                with pytest.raises(EngineError, match="no executor group formed again within 1s"):
                    for _ in stream:
                        pass
                with pytest.raises(
                    ServerUnavailableError, match="no executor is connected"
                ) as refused:
                    list(client.generate([1, 2], SamplingParams(max_tokens=2)))
                assert refused.value.code == "server_unavailable"
            finally:
                os.kill(new, signal.SIGCONT)


@pytest.mark.parametrize("executor_dies", [False, True])
def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny_model_dir, executor_dies):
    """In-flight requests finish with the tokens of an undisturbed run, new ones are refused;
    an executor that dies during the drain is started again, as at any other time."""
    proc = start_serve(tiny_model_dir, "--no-http", "--drain-timeout", "60")
    try:
        address = re.search(r"clients:\s+(\S+)", read_until(proc, "Press Ctrl-C")).group(1)
        with WeirClient(address, timeout=60) as client:
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            undisturbed = [t for o in client.generate([1, 2, 3], params) for t in o.new_token_ids]
            stream = client.generate([1, 2, 3], params)
            outputs = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            assert _wait_status(client, "draining", 30)["status"] == "draining"
            with pytest.raises(ServerUnavailableError, match="shutting down") as refused:
                list(client.generate([1, 2], SamplingParams(max_tokens=2)))
            assert refused.value.code == "server_unavailable"
            if executor_dies:
                (executor,) = [
                    pid
                    for pid in children_of(proc.pid)
                    if b"\0executor\0" in open(f"/proc/{pid}/cmdline", "rb").read()
                ]
                os.kill(executor, signal.SIGKILL)
            outputs += list(stream)
        assert [t for o in outputs for t in o.new_token_ids] == undisturbed
        assert outputs[-1].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
