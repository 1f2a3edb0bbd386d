"""The gateway's router in front of two real engine replicas."""

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import methodcaller

import httpx
import openai
import pytest
from serving_helpers import read_metrics

from weir.services.gateway.app import Gateway, create_app
from weir.services.gateway.router import Router
from weir.services.launcher import GatewayProcess, ServerProcesses, free_port
from weir.shared.client import AsyncWeirClient, WeirClient
from weir.shared.config import DEFAULT_MAX_MESSAGE_BYTES, EngineArgs
from weir.shared.sampling import SamplingParams

MODEL = "tiny-llama"


@contextlib.contextmanager
def _together(processes: list[ServerProcesses]) -> Iterator[list[ServerProcesses]]:
    """``processes`` (servers or gateways) started at once and stopped at once: most of a
    start or stop is waiting (children importing, a dead replica's health check timing out,
    a grace period). Stops what the list holds at the end (a test may replace one)."""
    try:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(methodcaller("start"), processes))
        yield processes
    finally:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(methodcaller("shutdown"), processes))


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    engine = EngineArgs(
        model=str(tiny_model_dir),
        block_size=4,
        kv_cache_memory=2 << 20,
        max_model_len=128,
        max_num_batched_tokens=64,
        device="cpu",
        threads=1,  # two servers on one machine: each executor's default would take every core
    )
    servers = [
        ServerProcesses(engine, port=0, metrics_port=0, executor_metrics_port=0) for _ in range(2)
    ]
    with _together(servers) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(replicas):
    with GatewayProcess([r.client_address for r in replicas], timeout=3) as process:
        yield process.info["http_address"]


def _routed(base: str, replicas) -> list[float]:
    samples = read_metrics(base + "/metrics")
    return [
        samples[f'weir_gateway_replica_requests_total{{replica="{r.client_address}"}}']
        for r in replicas
    ]


def _hits(replica) -> float:
    return read_metrics(replica.info["metrics_address"]).get(
        f'weir_prefix_cache_hit_tokens_total{{model_name="{MODEL}"}}', 0.0
    )


def _health(base: str) -> dict[str, bool]:
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as resp:
            return json.load(resp)["replicas"]
    except urllib.error.HTTPError as error:
        return json.load(error)["replicas"]


async def _complete_all(base: str, prompts: list, max_tokens: int = 4) -> list:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL,
                    prompt=p,
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in prompts
            ),
            return_exceptions=True,
        )


def test_concurrent_load_spreads_over_both_replicas(gateway, replicas):
    before = _routed(gateway, replicas)
    results = asyncio.run(_complete_all(gateway, [[[7 + i, 8, 9 + i]] for i in range(16)]))
    assert all(r.choices[0].finish_reason == "length" for r in results)
    delta = [a - b for a, b in zip(_routed(gateway, replicas), before)]
    assert sum(delta) == 16 and min(delta) >= 4, delta


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(gateway, replicas):
    prefix = "You are a helpful assistant who answers in one short sentence. " * 2  # 2 chunks
    before, hits_before = _routed(gateway, replicas), [_hits(r) for r in replicas]
    for i in range(6):
        asyncio.run(_complete_all(gateway, [prefix + f"Question {i}: why?"], max_tokens=2))
    delta = sorted(a - b for a, b in zip(_routed(gateway, replicas), before))
    assert delta == [0, 6]
    hits = sorted(h - h0 for h, h0 in zip([_hits(r) for r in replicas], hits_before))
    assert hits[0] == 0 and hits[1] >= 5 * 16  # five repeats, at least 4 blocks of 4 each


def _free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_a_new_gateway_serves_at_once_while_a_listed_replica_is_down(replicas):
    """The model's info (needed before the first request) is asked of the replicas that
    answer health checks, together: a dead one listed first costs no timeout. With every
    replica dead a request is a 503 at once, not after a timeout per replica."""
    dead = _free_address()
    gateways = [
        GatewayProcess([dead, replicas[1].client_address], timeout=30),
        GatewayProcess([dead, _free_address()], timeout=30),
    ]
    with _together(gateways):
        base = gateways[0].info["http_address"]
        deadline = time.monotonic() + 30
        while _health(base)[replicas[1].client_address] is not True:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        [result] = asyncio.run(_complete_all(base, [[[60, 61]]]))
        assert result.choices[0].finish_reason == "length"
        assert time.monotonic() - start < 10

        # An action for every replica is refused at once, naming the one that does not
        # answer, and changes none (the live one is not left paused). Sent together: each
        # waits out one health check of the dead replica.
        async def actions() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=20) as http:
                return await asyncio.gather(
                    http.post(base + "/pause"),
                    http.post(base + "/sleep"),
                    http.get(base + "/is_paused"),
                )

        for reply in asyncio.run(actions()):
            assert reply.status_code == 503 and dead in reply.json()["error"]["message"]
        with WeirClient(replicas[1].client_address) as live:
            assert not live.is_paused() and not live.is_sleeping()
        start = time.monotonic()
        [result] = asyncio.run(_complete_all(gateways[1].info["http_address"], [[[60, 61]]]))
        assert isinstance(result, openai.InternalServerError) and result.status_code == 503
        assert time.monotonic() - start < 10


def test_sigterm_stops_the_gateway_with_status_0():
    """As the scheduler and executor (uvicorn raises the signal again once stopped: 143).
    Its timeout is short: its start waits out a health check of its (dead) replica."""
    with GatewayProcess([_free_address()], timeout=0.5) as process:
        gateway = process._children[0].proc
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0


def test_the_log_says_when_a_replica_leaves_the_rotation_and_when_it_returns(replicas, caplog):
    """At the default level: an engine unreachable past the gateway's start (once, not per
    health check), and a replica back after a warning, at the warning's level. Each health
    check waits out the dead one's timeout (1 s: the live replica, idle, answers well within
    it)."""
    dead, live = _free_address(), replicas[0].client_address

    async def main() -> list[str]:
        router = Router([dead, live], timeout=1.0)
        said = []
        try:
            await router.check_health()
            said.append([r.getMessage() for r in caplog.records])  # starting: no news
            caplog.clear()
            router._quiet_until = 0.0
            await router.check_health()
            await router.check_health()
            router.mark_down(router.replicas[1], "a request failed")
            await router.check_health()
            said.append([r.getMessage() for r in caplog.records])
        finally:
            await router.close()
        return said

    with caplog.at_level(logging.WARNING, logger="weir.services.gateway.router"):
        starting, later = asyncio.run(main())
    assert starting == []
    assert later == [
        f"replica {dead} out of rotation: health check failed: no answer in 1.0s",
        f"replica {live} out of rotation: a request failed",
        f"replica {live} in rotation",
    ]


def test_a_rolling_update_loses_no_request(gateway, replicas):
    """SIGTERM drains a replica's scheduler: it finishes the stream it holds and refuses new
    requests, which the gateway sends to the other replica. Started again at its address,
    it rejoins the rotation.

    The refusals are met by an in-process gateway whose router checks health only when
    told: the gateway process's health checks (every second) might otherwise see the drain
    before the requests arrive, and route around it without a refusal to recover from."""
    draining = replicas[0]  # the router's first choice between two idle replicas
    executors = [c.proc.pid for c in draining._children if c.name.startswith("executor")]
    long_params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)

    async def drain_while_streaming() -> tuple[list, list, float, float]:
        router = Router([r.client_address for r in replicas], timeout=3)
        await router.check_health()
        app_gateway = Gateway(router, None, DEFAULT_MAX_MESSAGE_BYTES)
        transport = httpx.ASGITransport(create_app(app_gateway))
        base = "http://gateway"
        try:
            async with (
                AsyncWeirClient(draining.client_address) as sdk,
                openai.AsyncOpenAI(
                    base_url=base + "/v1",
                    api_key="x",
                    max_retries=0,
                    http_client=httpx.AsyncClient(transport=transport, base_url=base),
                ) as client,
            ):
                held = sdk.generate([3, 4, 5], long_params)
                outputs = [await anext(held)]
                for pid in executors:  # held, so the drain lasts while the others are sent
                    os.kill(pid, signal.SIGSTOP)
                try:
                    os.kill(draining._children[0].proc.pid, signal.SIGTERM)  # its scheduler
                    while (await sdk.health())["status"] != "draining":
                        await asyncio.sleep(0.01)
                    others = await asyncio.gather(
                        *(
                            client.completions.create(
                                model=MODEL, prompt=[[50 + i, 51]], max_tokens=4, temperature=0
                            )
                            for i in range(6)
                        ),
                        return_exceptions=True,
                    )
                finally:
                    for pid in executors:
                        os.kill(pid, signal.SIGCONT)
                outputs += [out async for out in held]
        finally:
            await router.close()
        registry = app_gateway.metrics.registry
        refused = registry.get_sample_value(
            "weir_gateway_replica_requests_total", {"replica": draining.client_address}
        )
        rerouted = registry.get_sample_value("weir_gateway_rerouted_requests_total")
        return outputs, others, refused, rerouted

    outputs, others, refused, rerouted = asyncio.run(drain_while_streaming())
    assert all(not isinstance(r, Exception) for r in others), others
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in others)
    assert refused >= 1 and rerouted == refused  # each refused one was sent on
    assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == 60
    assert draining._children[0].proc.wait(timeout=30) == 0  # drained, then stopped
    draining.shutdown()
    port = int(draining.client_address.rpartition(":")[2])
    replicas[0] = ServerProcesses(
        draining.engine_args, port=port, metrics_port=0, executor_metrics_port=0
    )
    replicas[0].start()
    deadline = time.monotonic() + 30
    while not all(_health(gateway).values()):
        assert time.monotonic() < deadline, "the restarted replica never rejoined"
        time.sleep(0.2)
    test_concurrent_load_spreads_over_both_replicas(gateway, replicas)


def test_tokenize_and_detokenize_go_on_to_another_replica(gateway, replicas):
    """A replica that does not answer (its scheduler stopped, before a health check saw
    it) costs /tokenize and /detokenize one timeout, then another replica answers them, as
    it answers generations."""
    scheduler = replicas[0]._children[0].proc.pid  # the replica the router tries first
    os.kill(scheduler, signal.SIGSTOP)
    try:
        tokenized = httpx.post(gateway + "/tokenize", json={"prompt": "Hello there"}, timeout=30)
        detokenized = httpx.post(gateway + "/detokenize", json={"tokens": [5, 6]}, timeout=30)
    finally:
        os.kill(scheduler, signal.SIGCONT)
    assert tokenized.status_code == 200, tokenized.text
    with WeirClient(replicas[1].client_address) as client:
        assert tokenized.json()["tokens"] == client.tokenize("Hello there")
        assert detokenized.json() == {"prompt": client.detokenize([5, 6])}
    deadline = time.monotonic() + 30
    while not all(_health(gateway).values()):  # back in the rotation for the next tests
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_lone_replica_that_stalls_a_few_seconds_queues_requests_not_refuses_them(replicas):
    """The only replica stalls (its scheduler stopped 4 s: a long pause, a starved CPU):
    requests sent meanwhile and after wait for it, as its engine keeps them; none is a
    503 for want of a ready replica, nor is the gateway's /health (its readiness)."""
    scheduler = replicas[1]._children[0].proc.pid
    with GatewayProcess([replicas[1].client_address], timeout=60) as process:
        base = process.info["http_address"]
        while not all(_health(base).values()):
            time.sleep(0.05)

        async def through_the_stall() -> tuple[list, list[int]]:
            sent, probes = [], []
            async with httpx.AsyncClient(timeout=60) as http:
                os.kill(scheduler, signal.SIGSTOP)
                try:
                    for _ in range(25):  # 5 s: the stall, and a second after
                        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
                        sent.append(
                            asyncio.ensure_future(http.post(f"{base}/v1/completions", json=body))
                        )
                        probes.append((await http.get(base + "/health")).status_code)
                        await asyncio.sleep(0.2)
                        if len(sent) == 20:
                            os.kill(scheduler, signal.SIGCONT)
                finally:
                    os.kill(scheduler, signal.SIGCONT)
                return [r.status_code for r in await asyncio.gather(*sent)], probes

        codes, probes = asyncio.run(through_the_stall())
    assert codes == [200] * 25 and probes == [200] * 25, (codes, probes)


def test_a_replica_silent_for_long_is_down_even_alone(replicas):
    """A stalled replica is a last resort only for a while: a scheduler silent for longer
    (a dead node whose connection never closes) must not make every request wait out the
    gateway's timeout, nor keep the gateway ready. Its own replica answered "ok" (a real
    health check), then a silence of 10 s is taken from its clock."""

    async def candidates_through_a_silence() -> list[int]:
        router = Router([replicas[1].client_address])
        [replica] = router.replicas
        try:
            await router.check_health()
            counts = [len(router.candidates())]
            router.mark_down(replica, "health check failed: no answer in 2.0s")
            counts.append(len(router.candidates()))
            replica.silent_since -= 10
            counts.append(len(router.candidates()))
        finally:
            await replica.client.close()
        return counts

    assert asyncio.run(candidates_through_a_silence()) == [1, 1, 0]


def test_requests_queued_on_a_hung_replica_go_to_another(replicas):
    """Requests waiting for their first output on a replica that hangs (its scheduler
    stopped) go to the other replica once the health check goes unanswered (2 s), not
    after the client's timeout (60 s here); with both hung they wait for either (an
    engine keeps its requests through a pause), rather than failing."""
    schedulers = [r._children[0].proc.pid for r in replicas]  # the first is tried first
    with GatewayProcess([r.client_address for r in replicas], timeout=60) as process:
        base = process.info["http_address"]

        def until_both_healthy() -> None:
            deadline = time.monotonic() + 30
            while not all(_health(base).values()):
                assert time.monotonic() < deadline
                time.sleep(0.2)

        until_both_healthy()
        prompts = [[[50 + i, 51, 52 + i]] for i in range(6)]
        os.kill(schedulers[0], signal.SIGSTOP)
        try:
            start = time.monotonic()
            results = asyncio.run(_complete_all(base, prompts))
            elapsed = time.monotonic() - start
            rerouted = read_metrics(base + "/metrics")["weir_gateway_rerouted_requests_total"]
        finally:
            os.kill(schedulers[0], signal.SIGCONT)
        until_both_healthy()

        async def both_hung_then_one_back() -> list:
            waiting = asyncio.ensure_future(_complete_all(base, prompts))
            async with httpx.AsyncClient(timeout=10) as http:
                deadline = time.monotonic() + 30
                while any((await http.get(base + "/health")).json()["replicas"].values()):
                    assert time.monotonic() < deadline, "a hung replica stayed in rotation"
                    await asyncio.sleep(0.1)
            os.kill(schedulers[1], signal.SIGCONT)  # both out of rotation till now
            return await waiting

        for pid in schedulers:
            os.kill(pid, signal.SIGSTOP)
        try:
            waited = asyncio.run(both_hung_then_one_back())
        finally:
            for pid in schedulers:
                os.kill(pid, signal.SIGCONT)
    assert elapsed < 20, elapsed
    assert rerouted >= 1
    with WeirClient(replicas[1].client_address) as client:
        for prompt, result, after in zip(prompts, results, waited, strict=True):
            assert result.choices[0].finish_reason == "length", result
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            expected = "".join(out.text for out in client.generate(prompt[0], params))
            assert result.choices[0].text == after.choices[0].text == expected, after


def test_a_killed_replica_leaves_no_request_hanging(gateway, replicas):
    # The victim is the one the router picks among equally loaded replicas.
    victim, survivor = replicas[0], replicas[1]
    prompts = [[[20 + i, 21, 22 + i]] for i in range(8)]

    async def kill_while_streaming() -> tuple[list, list]:
        task = asyncio.create_task(_complete_all(gateway, prompts, max_tokens=60))
        await asyncio.sleep(0.3)
        os.kill(victim._children[0].proc.pid, signal.SIGKILL)  # the replica's scheduler
        await asyncio.sleep(0.05)  # well before the next health check
        at_once = await _complete_all(gateway, [[[40 + i, 41]] for i in range(8)])
        return await asyncio.wait_for(task, 60), at_once

    start = time.monotonic()
    results, at_once = asyncio.run(kill_while_streaming())
    assert time.monotonic() - start < 60
    for result in results:  # each finished, or failed with an error: none hangs
        assert isinstance(result, openai.APIError) or result.choices[0].finish_reason == "length"
    # The closed connection took the replica out of rotation at once: nothing sent to it.
    assert all(r.choices[0].finish_reason == "length" for r in at_once), at_once
    deadline = time.monotonic() + 30
    while _health(gateway)[victim.client_address] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _health(gateway) == {survivor.client_address: True, victim.client_address: False}
    after = asyncio.run(_complete_all(gateway, [[[30 + i, 31]] for i in range(8)]))
    assert all(r.choices[0].finish_reason == "length" for r in after)
