"""vLLM's reinforcement-learning lifecycle over a real server: pausing the engine's steps
(aborting, waiting for or keeping the requests in flight, the cache dropped or kept),
resuming, dropping the prefix cache, and loading new weights (SGLang's
update_weights_from_disk); and vLLM's profiling between two steps (start_profile,
stop_profile); through the SDK and the HTTP routes. Kept requests resume where
they were and decode what transformers decodes (with the new weights once loaded),
recomputed when the cache was dropped; nothing accepted is lost."""

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from conftest import save_speaking
from safetensors.torch import load_file, save_file
from serving_helpers import (
    hf_greedy,
    metric,
    raw_dealer,
    read_metrics,
    small_server,
    stop_the_replacement,
    wait_for_metric,
)

from weir.services import LLM
from weir.services.launcher import EXECUTOR
from weir.shared.client import (
    InvalidRequestError,
    ServerUnavailableError,
    WeirClient,
)
from weir.shared.protocol import client as client_protocol
from weir.shared.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 230, 4000, 12, 9, 77, 310, 18, 64, 1024, 3, 88, 901, 45, 6, 2000, 13, 70]


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(tiny_model_dir, profiles):
    with small_server(tiny_model_dir, "tiny", profiler_dir=str(profiles)) as processes:
        yield processes


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _Stream(threading.Thread):
    """One request streamed in a thread: its token ids as they arrive, and its end."""

    def __init__(self, address: str, prompt, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.address, self.prompt, self.max_tokens = address, prompt, max_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        with WeirClient(self.address) as client:
            for out in client.generate(self.prompt, _greedy(self.max_tokens)):
                self.tokens += out.new_token_ids
                self.started.set()
                self.finish_reason = out.finish_reason
        self.started.set()


def _executor_pid(server) -> int:
    """The live executor's (the one ``weir serve`` started last)."""
    alive = [c for c in server._children if c.name.startswith(EXECUTOR) and c.proc.poll() is None]
    return alive[-1].proc.pid


def _quiet(stream: _Stream, seconds: float = 0.6) -> bool:
    before = len(stream.tokens)
    time.sleep(seconds)
    return len(stream.tokens) == before


@pytest.mark.parametrize("clear_cache", [True, False])
def test_a_kept_request_waits_out_the_pause_and_decodes_as_transformers(
    server, tiny_hf_model, clear_cache
):
    """Paused mid-stream with "keep", a request gets no token until the engine resumes, nor
    does one sent meanwhile; both then finish as transformers decodes them. With the cache
    dropped every block is free while paused (the kept request is computed again), kept
    otherwise."""
    other = PROMPT[::-1]
    want = hf_greedy(tiny_hf_model, PROMPT, 300)
    want_other = hf_greedy(tiny_hf_model, other, 20)
    with WeirClient(server.client_address) as client:
        stream = _Stream(server.client_address, PROMPT, 300)
        stream.start()
        assert stream.started.wait(60)
        client.pause("keep", clear_cache=clear_cache)
        assert client.is_paused()
        later = _Stream(server.client_address, other, 20)
        later.start()
        assert _quiet(stream) and not later.tokens and stream.finish_reason is None
        health = client.health()
        assert (health["num_free_blocks"] == health["num_blocks"]) == clear_cache
        client.resume()
        assert not client.is_paused()
        stream.join(120)
        later.join(120)
    assert (stream.tokens, stream.finish_reason) == (want, "length")
    assert (later.tokens, later.finish_reason) == (want_other, "length")


def test_a_paused_engine_whose_executor_dies_stays_paused_and_loses_nothing(server, tiny_hf_model):
    """SIGKILLed while paused, the executor is replaced; the engine stays paused, and on
    resuming the kept request finishes as transformers decodes it."""
    with WeirClient(server.client_address) as client:
        stream = _Stream(server.client_address, PROMPT, 200)
        stream.start()
        assert stream.started.wait(60)
        client.pause("keep", clear_cache=False)
        os.kill(_executor_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while client.health()["status"] != "ok" or time.monotonic() < deadline - 55:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert client.is_paused() and _quiet(stream)
        client.resume()
        stream.join(120)
    assert (stream.tokens, stream.finish_reason) == (
        hf_greedy(tiny_hf_model, PROMPT, 200),
        "length",
    )


def test_abort_ends_the_requests_in_flight_and_wait_lets_them_finish(server, tiny_hf_model):
    with WeirClient(server.client_address) as client:
        stream = _Stream(server.client_address, PROMPT, 400)
        stream.start()
        assert stream.started.wait(60)
        client.pause("abort")
        stream.join(30)
        assert stream.finish_reason == "abort" and 0 < len(stream.tokens) < 400
        assert stream.tokens == hf_greedy(tiny_hf_model, PROMPT, len(stream.tokens))
        client.resume()

        # "wait": the pause answers once the request in flight has finished; one sent
        # after the pause began waits for the resume.
        first = _Stream(server.client_address, PROMPT, 120)
        first.start()
        assert first.started.wait(60)
        pausing = threading.Thread(target=client.pause, args=("wait",), daemon=True)
        pausing.start()
        time.sleep(0.05)
        held = _Stream(server.client_address, PROMPT[:7], 10)
        held.start()
        pausing.join(120)
        assert first.finish_reason == "length" and len(first.tokens) == 120
        assert client.is_paused() and _quiet(held) and not held.tokens
        client.resume()
        held.join(60)
    assert held.tokens == hf_greedy(tiny_hf_model, PROMPT[:7], 10)


def _wait_healthy(client: WeirClient) -> None:
    deadline = time.monotonic() + 60
    while client.health()["status"] != "ok":
        assert time.monotonic() < deadline, "no executor group formed again"
        time.sleep(0.1)


@contextlib.contextmanager
def _executor_stopped_mid_stream(server) -> Iterator[_Stream]:
    """A 200-token stream under way, its executor stopped (SIGSTOP) for the block's time."""
    first = _Stream(server.client_address, PROMPT, 200)
    first.start()
    assert first.started.wait(60)
    executor = _executor_pid(server)
    os.kill(executor, signal.SIGSTOP)
    try:
        yield first
    finally:
        os.kill(executor, signal.SIGCONT)


def test_the_queue_gauges_follow_arrivals_while_a_step_runs(server):
    """A step may take seconds (a long prefill on a CPU; here its executor is stopped): the
    gauges a scrape reads count the requests that arrive meanwhile (they were refreshed only
    between steps, so a busy engine read as idle)."""
    waiting = 'weir_num_requests_waiting{model_name="tiny"}'
    running = 'weir_num_requests_running{model_name="tiny"}'
    with _executor_stopped_mid_stream(server) as first:
        # The scheduler plans the step after the one in flight as a result comes (async
        # scheduling): given a moment, it has done so before the arrivals, which then wait (on
        # one busy core, one was once taken into that step: waiting 2, running 2).
        time.sleep(0.2)
        queued = [_Stream(server.client_address, PROMPT[: 5 + i], 5) for i in range(3)]
        for stream in queued:
            stream.start()
        # Read before the scheduler gives the silent executor up (--executor-timeout, 3 s).
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            gauges = read_metrics(server.info["metrics_address"])
            if gauges[waiting] == 3:
                break
            time.sleep(0.05)
    assert (gauges[waiting], gauges[running]) == (3, 1)
    for stream in [first, *queued]:
        stream.join(60)
        assert stream.finish_reason == "length"


def test_requests_held_by_a_waiting_pause_are_known_and_abortable(server, tiny_hf_model):
    """While pause("wait") waits for the request in flight (its executor stopped, so it waits
    long enough to look), requests sent then are held: a health check naming them calls
    them lost only once aborted (the SDK fails a lost stream), an abort ends one at once
    with its last word, and the other decodes as transformers once the engine resumes."""
    with WeirClient(server.client_address) as client, raw_dealer(server.client_address) as sock:
        with _executor_stopped_mid_stream(server) as first:
            pausing = threading.Thread(target=client.pause, args=("wait",), daemon=True)
            pausing.start()
            time.sleep(0.5)  # the pause is waiting: what comes now is held
            for msg in (
                client_protocol.GenerateRequest("held-1", PROMPT[:7], _greedy(5)),
                client_protocol.GenerateRequest("held-2", PROMPT[:9], _greedy(5)),
                client_protocol.AbortRequest("held-2"),
                client_protocol.HealthRequest("probe", ["held-1", "held-2"]),
            ):
                sock.send(client_protocol.encode_client_message(msg))
            answers = []
            while not any(isinstance(a, client_protocol.HealthReply) for a in answers):
                assert sock.poll(10_000), "no answer while the pause waits"
                msg = client_protocol.decode_server_message(sock.recv())
                answers += msg if isinstance(msg, list) else [msg]
        aborted, health = answers
        assert (aborted.request_id, aborted.finished, aborted.finish_reason) == (
            "held-2",
            True,
            "abort",
        )
        assert health.info["lost_request_ids"] == ["held-2"]
        pausing.join(60)
        assert first.finish_reason == "length" and client.is_paused()
        client.resume()
        tokens = []
        while True:
            assert sock.poll(60_000), "the held request never ran"
            outs = client_protocol.decode_server_message(sock.recv())
            tokens += [t for out in outs for t in out.new_token_ids]
            if outs[-1].finished:
                break
        assert tokens == hf_greedy(tiny_hf_model, PROMPT[:7], 5)


def test_an_executor_lost_while_the_engine_goes_to_sleep_leaves_it_awake(server):
    """sleep() pauses the engine, then the executors are lost before they sleep: the call
    fails, naming that, and the group that replaces them serves, unpaused (the engine was
    not paused before the sleep)."""
    with WeirClient(server.client_address) as client:
        executor = _executor_pid(server)
        os.kill(executor, signal.SIGSTOP)
        failed: list[BaseException] = []

        def sleep() -> None:
            try:
                client.sleep(1)
            except BaseException as exc:
                failed.append(exc)

        sleeping = threading.Thread(target=sleep, daemon=True)
        sleeping.start()
        time.sleep(0.3)
        os.kill(executor, signal.SIGKILL)
        sleeping.join(60)
        assert len(failed) == 1 and isinstance(failed[0], ServerUnavailableError), failed
        assert "sleep: the executors were lost" in str(failed[0])
        _wait_healthy(client)
        assert not client.is_paused()
        assert len(list(_tokens(client, PROMPT[:7], 5))) == 5


def test_executors_replaced_while_the_engine_sleeps_wake_it(server):
    """The group that replaces a sleeping one starts awake, holding its memory: the engine
    says so and resumes, as a wake_up would (it said it slept, and held its requests, with
    the new executors awake), and a wake_up meanwhile is a retry's 503, not an engine error."""
    with WeirClient(server.client_address) as client:
        client.sleep(1)
        lost = _executor_pid(server)
        os.kill(lost, signal.SIGKILL)
        replacement = stop_the_replacement(server, lost)
        deadline = time.monotonic() + 60
        while client.health()["status"] == "ok":  # until the scheduler saw the loss
            assert time.monotonic() < deadline, "the lost executor was never noticed"
            time.sleep(0.05)
        with pytest.raises(ServerUnavailableError, match="wake_up: the executors were lost"):
            client.wake_up()
        os.kill(replacement, signal.SIGCONT)
        while client.is_sleeping():
            assert time.monotonic() < deadline, "the replaced executors' engine still sleeps"
            time.sleep(0.1)
        assert not client.is_paused()
        assert len(list(_tokens(client, PROMPT[:7], 5))) == 5


def test_the_http_routes_pause_resume_and_drop_the_prefix_cache(server):
    http = server.info["http_address"]
    metrics = server.info["metrics_address"]

    def hits() -> float:
        return metric(read_metrics(metrics), "weir_prefix_cache_hit_tokens_total")

    reply = httpx.post(http + "/pause", params={"mode": "keep"}, timeout=60)
    assert reply.status_code == 200 and reply.json() == {"is_paused": True}
    assert httpx.get(http + "/is_paused", timeout=10).json() == {"is_paused": True}
    assert metric(read_metrics(metrics), "weir_engine_paused") == 1
    assert httpx.post(http + "/resume", timeout=10).json() == {"is_paused": False}
    assert metric(read_metrics(metrics), "weir_engine_paused") == 0
    bad = httpx.post(http + "/pause", params={"mode": "later"}, timeout=10)
    assert bad.status_code == 400 and "mode must be one of" in bad.json()["error"]["message"]

    prompt = list(range(100, 164))  # four whole blocks
    with WeirClient(server.client_address) as client:
        list(client.generate(prompt, _greedy(1)))
        before = hits()
        list(client.generate(prompt, _greedy(1)))
        # The second read the first's blocks (the counters follow the reply: waited for).
        hits_before_reset = wait_for_metric(
            metrics, "weir_prefix_cache_hit_tokens_total", before + 1
        )
        assert httpx.post(http + "/reset_prefix_cache", timeout=10).status_code == 200
        queries = "weir_prefix_cache_query_tokens_total"
        queried = metric(read_metrics(metrics), queries)
        list(client.generate(prompt, _greedy(1)))
        wait_for_metric(metrics, queries, queried + 1)  # its lookup counted, and no hit
        assert hits() == hits_before_reset


def test_a_profile_holds_the_steps_between_start_and_stop(server, profiles):
    """/start_profile and /stop_profile (vLLM's): the executor writes a Chrome trace of the
    steps between (each step's launch and finish, the operators under them) and a table of
    its operators. A stop without a start and a second start are refused, and the engine
    goes on serving."""
    http = server.info["http_address"]
    earlier = set(profiles.iterdir())  # other tests' profiles
    stop = httpx.post(http + "/stop_profile", timeout=10)
    assert stop.status_code == 400 and "no profile is running" in stop.json()["error"]["message"]
    started = httpx.post(http + "/start_profile", timeout=60)
    assert started.status_code == 200 and not started.content
    again = httpx.post(http + "/start_profile", timeout=10)
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    with WeirClient(server.client_address) as client:
        assert sum(len(out.new_token_ids) for out in client.generate(PROMPT, _greedy(3))) == 3
    assert httpx.post(http + "/stop_profile", timeout=60).status_code == 200

    written = set(profiles.iterdir()) - earlier
    (trace,) = [p for p in written if p.name.startswith("executor0-") and p.suffix == ".json"]
    (table,) = [p for p in written if p.name.startswith("executor0-") and p.suffix == ".txt"]
    names = [event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]]
    # The plan that started it (it schedules nothing), the prefill and two decodes, and
    # greedy sampling in each of the three.
    assert names.count("weir::launch") == names.count("weir::finish") == 4
    assert "aten::max" in names and "aten::max" in table.read_text()


def test_a_stop_the_new_executor_refuses_loses_no_request(server, tiny_hf_model):
    """An executor SIGKILLed while profiling is replaced by one that records nothing: the stop
    is a 400 (the new one has no profile to stop), the request held (paused, "keep") through
    all of it decodes as transformers does once resumed, and profiling works again."""
    http = server.info["http_address"]
    with WeirClient(server.client_address) as client:
        stream = _Stream(server.client_address, PROMPT, 200)
        stream.start()
        assert stream.started.wait(60)
        client.pause("keep", clear_cache=False)
        assert httpx.post(http + "/start_profile", timeout=60).status_code == 200
        os.kill(_executor_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while client.health()["status"] != "ok" or time.monotonic() < deadline - 55:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        stop = httpx.post(http + "/stop_profile", timeout=60)
        assert stop.status_code == 400
        assert "no profile is running" in stop.json()["error"]["message"]
        assert client.is_paused() and _quiet(stream, 0.2)
        client.resume()
        stream.join(120)
        assert httpx.post(http + "/start_profile", timeout=60).status_code == 200
        assert httpx.post(http + "/stop_profile", timeout=60).status_code == 200
    assert (stream.tokens, stream.finish_reason) == (
        hf_greedy(tiny_hf_model, PROMPT, 200),
        "length",
    )


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory, tiny_model_dir, default_model_dir):
    """Other weights of the served tiny model's architecture (as a trainer's next
    checkpoint), transformers' model of them, and a directory of another shape."""
    path = tmp_path_factory.mktemp("trained") / "step-2"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(7)
    save_speaking(model, path, default_model_dir)
    other = tmp_path_factory.mktemp("other") / "wider"
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size = 96
    save_speaking(transformers.AutoModelForCausalLM.from_config(config), other, default_model_dir)
    return path, model.eval(), other


def test_new_weights_serve_the_requests_in_flight_and_every_later_one(
    server, tiny_model_dir, tiny_hf_model, new_weights, tmp_path
):
    """Loaded mid-stream, new weights compute the rest of a request in flight (its tokens
    so far computed again with them) and every request after, also on the executor that
    replaces a killed one; weights that do not fit, or that an executor cannot load, are
    refused, and the weights served before go on serving."""
    path, trained, other = new_weights
    url = server.info["metrics_address"]
    updates = metric(read_metrics(url), "weir_weight_updates_total")
    with WeirClient(server.client_address) as client:
        stream = _Stream(server.client_address, PROMPT, 300)
        stream.start()
        assert stream.started.wait(60)
        client.update_weights_from_disk(str(path))
        stream.join(120)
        assert not client.is_paused()
        tokens = stream.tokens
        old = hf_greedy(tiny_hf_model, PROMPT, len(tokens))
        split = next((i for i, (a, b) in enumerate(zip(tokens, old)) if a != b), len(tokens))
        assert 0 < split < len(tokens) and stream.finish_reason == "length"
        rest = hf_greedy(trained, PROMPT + tokens[:split], len(tokens) - split)
        assert tokens[split:] == rest
        want = hf_greedy(trained, PROMPT[:9], 12)
        assert list(_tokens(client, PROMPT[:9], 12)) == want

        with pytest.raises(InvalidRequestError, match="describes another model"):
            client.update_weights_from_disk(str(other))
        with pytest.raises(InvalidRequestError, match="config.json: cannot be read"):
            client.update_weights_from_disk(str(tmp_path / "nowhere"))
        broken = tmp_path / "broken"
        shutil.copytree(path, broken)
        tensors = load_file(broken / "model.safetensors")
        tensors.pop("model.layers.1.mlp.up_proj.weight")
        save_file(tensors, broken / "model.safetensors")
        with pytest.raises(InvalidRequestError, match="could not load the weights of"):
            client.update_weights_from_disk(str(broken))
        assert list(_tokens(client, PROMPT[:9], 12)) == want

        os.kill(_executor_pid(server), signal.SIGKILL)
        # The executor that replaces it starts with the served model's directory, and is sent
        # the weights loaded since before its first step.
        assert list(_tokens(client, PROMPT[:9], 12)) == want
        client.update_weights_from_disk(str(tiny_model_dir))
        assert metric(read_metrics(url), "weir_weight_updates_total") == updates + 2
        assert list(_tokens(client, PROMPT[:9], 12)) == hf_greedy(tiny_hf_model, PROMPT[:9], 12)
    reply = httpx.post(
        server.info["http_address"] + "/update_weights_from_disk",
        json={"model_path": str(other)},
        timeout=60,
    )
    assert reply.status_code == 400 and "describes another model" in reply.text


def _tokens(client: WeirClient, prompt, max_tokens: int):
    for out in client.generate(prompt, _greedy(max_tokens)):
        yield from out.new_token_ids


def test_llm_loads_new_weights_and_drops_its_prefix_cache(tiny_model_dir, new_weights):
    path, trained, _ = new_weights
    with LLM(model=str(tiny_model_dir), max_model_len=256) as llm:
        llm.reset_prefix_cache()
        llm.update_weights_from_disk(path)
        [out] = llm.generate([PROMPT[:9]], _greedy(12))
    assert out.token_ids == hf_greedy(trained, PROMPT[:9], 12)


def test_weights_wake_alone_to_load_new_ones_before_the_kv_cache(tiny_model_dir, new_weights):
    """vLLM's partial wake-up, as an RL trainer drives it (verl's order): after a level-2
    sleep the weights wake alone (the engine still sleeps, a request sent waits), new
    weights load into them, then the KV cache wakes and the request runs on the new
    weights. The cache cannot wake before the weights, nor weights load while asleep."""
    path, trained, _ = new_weights
    with LLM(model=str(tiny_model_dir), max_model_len=256) as llm:
        llm.sleep(level=2)
        with pytest.raises(InvalidRequestError, match="tags weights"):
            llm.update_weights_from_disk(path)
        with pytest.raises(InvalidRequestError, match="wake the weights first"):
            llm.wake_up(["kv_cache"])
        llm.wake_up(["weights"])
        assert llm.is_sleeping()
        waiting: list[list[int]] = []
        sent = threading.Thread(
            target=lambda: waiting.append(llm.generate([PROMPT[:9]], _greedy(12))[0].token_ids)
        )
        sent.start()
        sent.join(timeout=1.0)
        assert sent.is_alive()  # the KV cache still sleeps: the engine does not step
        llm.update_weights_from_disk(path)
        assert llm.is_sleeping()
        llm.wake_up(["kv_cache"])
        sent.join(timeout=60)
        assert not llm.is_sleeping()
        assert waiting == [hf_greedy(trained, PROMPT[:9], 12)]
