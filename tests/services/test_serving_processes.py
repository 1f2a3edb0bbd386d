"""Process lifecycle: `weir serve` start-up, supervision and shutdown; executor death and recovery."""

import contextlib
import dataclasses
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import msgpack
import psutil
import pytest
import zmq

from weir.services import launcher
from weir.services.launcher import GatewayProcess, free_port
from weir.services.sigterm import Terminated, raise_terminated
from weir.shared.client import ServerUnavailableError, WeirClient, WeirError
from weir.shared.config import EngineArgs
from weir.shared.protocol import control
from weir.shared.sampling import SamplingParams

WEIR = [sys.executable, "-m", "weir.services.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 120.0) -> str:
    """stdout of ``proc`` (opened unbuffered, bytes) up to the first ``marker``."""
    data, deadline = b"", time.monotonic() + timeout
    while marker.encode() not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            raise AssertionError(f"no {marker!r} in output: {data!r} (exit code {proc.poll()})")
        if select.select([proc.stdout], [], [], remaining)[0]:
            data += os.read(proc.stdout.fileno(), 65536)
    return data.decode()


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def serve_argv(model_dir: Path, *extra: str) -> list[str]:
    """`weir serve` of ``model_dir`` on free ports (a flag in ``extra`` overrides)."""
    return [
        *WEIR,
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--executor-metrics-port",
        "0",
        *extra,
    ]


def start_serve(
    model_dir: Path, *extra: str, stderr: int | None = None, env: dict[str, str] = ENV
) -> subprocess.Popen:
    """`weir serve` on free ports with a small KV cache; stdout unbuffered, for read_until."""
    return subprocess.Popen(
        serve_argv(model_dir, "--kv-cache-memory", "1MiB", *extra),
        stdout=subprocess.PIPE,
        stderr=stderr,
        bufsize=0,
        env=env,
    )


def test_sigterm_while_the_gateway_starts_drains_what_the_scheduler_took(
    tiny_model_dir, monkeypatch
):
    """The scheduler takes requests before `weir serve` is up (its gateway still starting):
    a SIGTERM then drains them, as after the start. Abandoning the start killed the
    executors, so they all failed (connection lost) at the end of the drain timeout."""
    engine = EngineArgs(model=str(tiny_model_dir), kv_cache_memory=1 << 20, threads=1, device="cpu")
    server = launcher.ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, http_port=0
    )
    streaming, outputs = threading.Event(), []
    start_gateway = server._start_gateway

    def gateway_after_a_request(schedulers, *extra):
        def request() -> None:
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            with WeirClient(schedulers[0]) as client:
                for out in client.generate("Hello", params):
                    outputs.append(out)
                    streaming.set()

        threading.Thread(target=request, daemon=True).start()
        assert streaming.wait(60)
        os.kill(os.getpid(), signal.SIGTERM)  # raised here, in the main thread
        return start_gateway(schedulers, *extra)

    monkeypatch.setattr(server, "_start_gateway", gateway_after_a_request)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(Terminated):
            server.start()
        assert all(child.proc.poll() is None for child in server._children)
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.shutdown(drain=True)
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outputs) == 40


def test_serve_generate_and_sigterm_leave_no_process_behind(tiny_model_dir):
    """The engine on IPv6 loopback (vLLM's --host takes one), the API apart (--http-host);
    its stop says nothing, warnings shown (a file left open at exit is one)."""
    flags = ("--host", "::1", "--http-host", "127.0.0.1", "--api-key", "k")
    warnings = {**ENV, "PYTHONWARNINGS": "default"}
    proc = start_serve(
        tiny_model_dir, "--http-port", "0", *flags, stderr=subprocess.PIPE, env=warnings
    )
    try:
        banner = read_until(proc, "Press Ctrl-C")
        address = re.search(r"clients:\s+(\S+)", banner).group(1)
        http = re.search(r"HTTP:\s+(\S+)", banner).group(1)
        assert address.startswith("tcp://[::1]:") and http.startswith("http://127.0.0.1:")
        children = children_of(proc.pid)
        assert len(children) == 3  # the scheduler, one executor and the HTTP gateway
        models = urllib.request.Request(f"{http}/models", headers={"Authorization": "Bearer k"})
        with urllib.request.urlopen(models, timeout=30) as resp:
            assert json.load(resp)["data"][0]["id"] == "tiny-llama"
        out = subprocess.run(
            [
                *WEIR,
                "generate",
                "Hello",
                "--max-tokens",
                "5",
                "--ignore-eos",
                "--address",
                address,
                "-v",
            ],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "5 completion tokens, finish_reason=length" in out.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not [pid for pid in children if alive(pid)]
        stopped = proc.stderr.read().decode()
        assert "Warning" not in stopped and "Traceback" not in stopped, stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("asked", [True, False])
def test_vllms_logging_flags_start_and_log_requests(tiny_model_dir, asked):
    """vLLM's command lines start Weir: --enable-log-requests logs each request the gateway
    sends on (at INFO, whatever --log-level), --uvicorn-log-level the HTTP server's lines;
    --disable-log-requests and --disable-log-stats change nothing. Unasked, no prompt is
    logged, at --log-level INFO too (vLLM's)."""
    flags = (
        ("--enable-log-requests", "--disable-log-requests", "--disable-log-stats")
        if asked
        else ("--log-level", "INFO")
    )
    proc = start_serve(
        tiny_model_dir,
        "--http-port",
        "0",
        *flags,
        "--uvicorn-log-level",
        "info",
        "--kv-cache-memory",  # less than the tiny model's context takes
        "32KiB",
        stderr=subprocess.PIPE,
    )
    try:
        http = re.search(r"HTTP:\s+(\S+)", read_until(proc, "Press Ctrl-C")).group(1)
        body = json.dumps({"prompt": "Hello there", "max_tokens": 2, "temperature": 0})
        call = urllib.request.Request(
            f"{http}/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(call, timeout=30) as resp:
            completion_id = json.load(resp)["id"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        logged = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    line = f"request {completion_id}-0: prompt 'Hello there', SamplingParams("
    assert (line in logged) == asked and ("Hello there" in logged) == asked, logged
    # A cache too small for max_model_len is said at start (vLLM's start fails).
    assert re.search(r"holds \d+ tokens .* fewer than a request of max_model_len", logged)
    assert "uvicorn.error: Started server process" in logged, logged


def test_serve_exits_nonzero_with_the_childs_error(tmp_path):
    missing = tmp_path / "no-such-model"
    out = subprocess.run(
        serve_argv(missing),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 1
    assert "no-such-model" in out.stderr and "weir serve:" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "broken, message",
    [
        ("config.json", "config.json has no 'num_attention_heads'"),
        ("tokenizer.json", "tokenizer.json: cannot be read"),
    ],
)
def test_a_malformed_model_directory_is_one_line_naming_the_file(
    tiny_model_dir, tmp_path, broken, message
):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    if broken == "config.json":
        config = json.loads((model / broken).read_text())
        del config["num_attention_heads"]
        (model / broken).write_text(json.dumps(config))
    else:
        (model / broken).write_text("{")
    out = subprocess.run(serve_argv(model), capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 1
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--port", "cannot bind tcp://127.0.0.1:{port}: Address already in use (--port)"),
        ("--metrics-port", "cannot serve /metrics on 127.0.0.1:{port}: Address already in use"),
        ("--executor-metrics-port", "(--metrics-port; under `weir serve`: --executor-metrics"),
        ("--http-port", "cannot serve HTTP on 127.0.0.1:{port}: Address already in use"),
    ],
)
def test_a_port_in_use_is_named_without_a_traceback(tiny_model_dir, flag, message):
    """The one child that cannot bind says which port and option; the others, stopped while
    they were still starting, print nothing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            serve_argv(tiny_model_dir, "--http-port", "0", flag, str(port)),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
    assert out.returncode == 1
    assert message.format(port=port) in out.stderr.splitlines()[-1], out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.fixture
def standalone_scheduler(tiny_model_dir, tmp_path, request):
    """`weir scheduler` alone (as in Kubernetes), waiting for executors on an ipc socket; an
    indirect parameter adds scheduler flags."""
    port = free_port()
    executor_address = f"ipc://{tmp_path}/executors.sock"
    procs: list[subprocess.Popen] = []

    def start_executor(*extra: str) -> subprocess.Popen:
        executor = subprocess.Popen(
            [
                *WEIR,
                "executor",
                "--scheduler",
                executor_address,
                "--model",
                str(tiny_model_dir),
                "--metrics-port",
                "0",
                "--kv-cache-memory",
                "1MiB",
                *extra,
            ],
            env=ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(executor)
        return executor

    scheduler = subprocess.Popen(
        [
            *WEIR,
            "scheduler",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--executor-address",
            executor_address,
            *getattr(request, "param", ()),
        ],
        env=ENV,
    )
    procs.append(scheduler)
    try:
        yield f"tcp://127.0.0.1:{port}", start_executor, executor_address
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_healthy(client: WeirClient, status: str = "ok", timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = client.health()
        if health["status"] == status:
            return health
        time.sleep(0.05)
    raise AssertionError(f"server never became {status!r}: {health}")


# The killed executor is given up after 2 s without a heartbeat (3 s by default).
@pytest.mark.parametrize("standalone_scheduler", [("--executor-timeout", "2")], indirect=True)
def test_a_killed_executors_requests_finish_on_the_executor_started_next(standalone_scheduler):
    address, start_executor, _ = standalone_scheduler
    # An executor whose KV layout disagrees with the scheduler's is turned away at the
    # handshake, which checks the layout first: whether or not the other one joined before.
    mismatched = start_executor("--block-size", "8")
    executor = start_executor()
    assert mismatched.wait(timeout=120) == 1
    assert "block_size 8 != scheduler block_size 16" in mismatched.stderr.read()

    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with WeirClient(address, timeout=60) as client:
        assert wait_healthy(client)["executors"] == [0]
        undisturbed = [t for o in client.generate([1, 2, 3], params) for t in o.new_token_ids]
        stream = client.generate([1, 2, 3], params)
        outputs = [next(stream)]
        executor.kill()
        wait_healthy(client, "recovering")
        start_executor()  # as Kubernetes restarts the pod
        outputs += list(stream)
        assert [t for o in outputs for t in o.new_token_ids] == undisturbed
        health = wait_healthy(client)
        assert health["num_free_blocks"] == health["num_blocks"]


def test_frames_no_executor_should_send_leave_the_scheduler_serving(standalone_scheduler):
    """The executor socket takes anyone who can reach it (without keys: any local process).
    Frames of any shape, a hello the group cannot use, and step errors from a peer that is
    no rank must neither end the scheduler nor fail a request."""
    address, start_executor, executor_address = standalone_scheduler
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.connect(executor_address)
    try:
        with WeirClient(address, timeout=60) as client:
            info = wait_healthy(client, "waiting_for_executors") and client.model_info()
            hello = control.ExecutorHello(
                "rogue", 0, 1, info["model_name"], info["vocab_size"], 0, 16, 10**6, 10**6,
                10**6, [2], "float32", "cpu", "torch",
            )  # fmt: skip
            # No blocks; more than the scheduler can keep (10**7 took it 1.25 GB and seconds).
            for num_blocks, words in ((0, "0 KV blocks"), (2**31, "at most 4194304")):
                too_many = dataclasses.replace(hello, num_blocks=num_blocks)
                peer.send_multipart([control.HELLO, control.pack(too_many)])
                assert peer.poll(30_000), "the scheduler answered nothing"
                kind, payload = peer.recv_multipart()
                assert kind == control.REJECT
                assert words in control.unpack(control.Rejection, payload).message

            start_executor()
            wait_healthy(client)
            params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
            undisturbed = [t for o in client.generate([1, 2, 3], params) for t in o.new_token_ids]
            stream = client.generate([1, 2, 3], params)
            outputs = [next(stream)]
            for frames in (
                [control.HEARTBEAT, msgpack.packb({b"session": 1, "rank": 2})],
                [control.HEARTBEAT, b"\xc1"],
                [control.RESULT, b"not a result"],
                [b"who", b"knows", b"three frames"],
                [control.STEP_ERROR, msgpack.packb([1, 2])],
            ):
                peer.send_multipart(frames)
            spoofing = threading.Event()

            def spoof() -> None:  # step errors for every step id the stream may be in
                while not spoofing.is_set():
                    for step_id in range(1024):
                        failure = control.StepFailure(step_id, 0, "spoofed")
                        peer.send_multipart([control.STEP_ERROR, control.pack(failure)])

            spoofer = threading.Thread(target=spoof)
            spoofer.start()
            try:
                outputs += list(stream)
            finally:
                spoofing.set()
                spoofer.join()
            assert [t for o in outputs for t in o.new_token_ids] == undisturbed
            assert wait_healthy(client)["executors"] == [0]
    finally:
        context.destroy(linger=0)


def test_a_stalled_scheduler_gives_no_live_ranks_place_to_a_newcomer(standalone_scheduler):
    """A rank's silence while the scheduler's own loop is stalled proves nothing: its
    heartbeats wait unread behind a newcomer's hello. The newcomer (here a rogue peer that
    would answer every step wrongly) must be refused, and the stream go on undisturbed."""
    address, start_executor, executor_address = standalone_scheduler
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.connect(executor_address)
    scheduler = None
    try:
        with WeirClient(address, timeout=60) as client:
            start_executor()
            wait_healthy(client)
            info = client.model_info()
            scheduler = next(
                p for p in psutil.Process().children() if "scheduler" in " ".join(p.cmdline())
            )
            params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
            undisturbed = [t for o in client.generate([1, 2, 3], params) for t in o.new_token_ids]
            stream = client.generate([1, 2, 3], params)
            outputs = [next(stream)]

            def hello(n: int) -> list[bytes]:
                rogue = control.ExecutorHello(
                    f"rogue-{n}", 0, 1, info["model_name"], info["vocab_size"], 64, 16, 10**6,
                    10**6, 10**6, [2], "float32", "cpu", "torch",
                )  # fmt: skip
                return [control.HELLO, control.pack(rogue)]

            scheduler.suspend()  # as a long tokenization or a GC pause would hold the loop
            for n in range(60):
                peer.send_multipart(hello(n))
                time.sleep(0.05)
            scheduler.resume()
            for n in range(60, 80):
                peer.send_multipart(hello(n))
                time.sleep(0.05)
            outputs += list(stream)
            replies = []  # one per hello
            while len(replies) < 80 and peer.poll(2_000):
                replies.append(peer.recv_multipart()[0])
            assert replies and set(replies) == {control.REJECT}, replies
            assert [t for o in outputs for t in o.new_token_ids] == undisturbed
            assert wait_healthy(client)["executors"] == [0]
    finally:
        if scheduler is not None and scheduler.is_running():
            scheduler.resume()
        context.destroy(linger=0)


def test_weir_health_is_ready_only_once_an_executor_has_joined(standalone_scheduler):
    address, start_executor, _ = standalone_scheduler

    def weir_health() -> subprocess.CompletedProcess:
        return subprocess.run(
            [*WEIR, "health", "--address", address, "--timeout", "10"],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=60,
        )

    deadline = time.monotonic() + 60
    out = weir_health()
    while "ServerUnavailableError" in out.stderr and time.monotonic() < deadline:
        out = weir_health()  # the scheduler is still binding its socket
    assert out.returncode == 1 and "status=waiting_for_executors" in out.stdout, out
    start_executor()
    with WeirClient(address, timeout=60) as client:
        wait_healthy(client)
    out = weir_health()
    assert out.returncode == 0 and "status=ok" in out.stdout, out


def test_a_stream_fails_clearly_when_the_scheduler_restarts_under_it(tiny_model_dir, tmp_path):
    port = free_port()
    executor_address = f"ipc://{tmp_path}/executors.sock"
    scheduler_cmd = [
        *WEIR,
        "scheduler",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--executor-address",
        executor_address,
    ]
    executor_cmd = [
        *WEIR,
        "executor",
        "--scheduler",
        executor_address,
        "--model",
        str(tiny_model_dir),
        "--metrics-port",
        "0",
        "--kv-cache-memory",
        "1MiB",
    ]
    procs = [subprocess.Popen(scheduler_cmd, env=ENV), subprocess.Popen(executor_cmd, env=ENV)]
    try:
        with WeirClient(f"tcp://127.0.0.1:{port}", timeout=10) as client:
            wait_healthy(client)
            stream = client.generate(
                [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True, temperature=0.0)
            )
            next(stream)
            procs[0].kill()
            procs[0].wait()
            procs.append(subprocess.Popen(scheduler_cmd, env=ENV))
            # The closed connection fails the stream (the new scheduler never heard of it),
            # and the client reaches the new scheduler for what it sends next.
            with pytest.raises(ServerUnavailableError, match="connection to .* was lost"):
                for _ in stream:
                    pass
            assert wait_healthy(client, "waiting_for_executors")["num_streams"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_sampling_flags_exit_2_with_the_reason(command):
    argv = [*WEIR, command, *(["hi"] if command == "generate" else []), "--temperature", "-1"]
    out = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 2
    assert f"weir {command}: temperature must be >= 0" in out.stderr


def test_a_stream_notices_a_killed_scheduler_at_once(standalone_scheduler):
    """The connection closes with the process: the stream fails then, not after the
    client's timeout (a scheduler that hangs instead is test_client_streams.py's case)."""
    address, start_executor, _ = standalone_scheduler
    start_executor()
    with WeirClient(address, timeout=60) as client:
        wait_healthy(client)
        stream = client.generate(
            [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
        )
        next(stream)
        os.kill(scheduler_pid(address), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="connection to .* was lost"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 5


def scheduler_pid(address: str) -> int:
    """The pid of this test's `weir scheduler` serving clients at ``address``."""
    port = address.rsplit(":", 1)[1].encode()
    return next(
        pid
        for pid in children_of(os.getpid())
        if b"\0scheduler\0" in (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes())
        and b"\0" + port + b"\0" in cmdline
    )


@pytest.mark.parametrize(
    "standalone_scheduler", [("--max-num-seqs", "1", "--drain-timeout", "120")], indirect=True
)
@pytest.mark.parametrize("first", ["executor", "scheduler", "scheduler, then killed"])
def test_pods_stopped_together_finish_the_requests_in_flight(standalone_scheduler, first):
    """A node drain (or `kubectl delete`) sends SIGTERM to the scheduler's pod and the
    executor's at once, in either order: the scheduler drains, and its executor serves on until
    the scheduler has drained. A draining scheduler killed (its grace over) leaves the
    executor to stop by itself, not serve on an engine that is gone."""
    address, start_executor, _ = standalone_scheduler
    executor = start_executor()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    with WeirClient(address, timeout=60) as client:
        wait_healthy(client)
        reference = [t for o in client.generate([1, 2, 3], params) for t in o.new_token_ids]
        results: list[list[int]] = []

        def generate() -> None:
            with WeirClient(address, timeout=60) as own, contextlib.suppress(WeirError):
                results.append(
                    [t for o in own.generate([1, 2, 3], params) for t in o.new_token_ids]
                )

        # One runs at a time (--max-num-seqs 1): the others wait, for seconds in all.
        threads = [threading.Thread(target=generate) for _ in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while client.health()["num_requests_waiting"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    scheduler = scheduler_pid(address)
    pids = {"executor": executor.pid, "scheduler": scheduler}
    os.kill(pids.pop(first.split(",")[0]), signal.SIGTERM)
    time.sleep(0.5)
    os.kill(pids.popitem()[1], signal.SIGTERM)
    if first == "scheduler, then killed":
        time.sleep(0.5)
        os.kill(scheduler, signal.SIGKILL)
        assert executor.wait(timeout=15) == 0
    for thread in threads:
        thread.join(timeout=120)
    if first != "scheduler, then killed":
        assert results == [reference] * 6
    assert executor.wait(timeout=30) == 0


def test_a_gateway_queues_nothing_on_a_scheduler_that_was_never_ready(standalone_scheduler):
    """A scheduler still waiting for its executors that then goes silent (stopped) is not a
    stalled engine to wait for: the gateway stays unready and refuses at once (503)."""
    address, _, _ = standalone_scheduler
    pid = scheduler_pid(address)
    with GatewayProcess([address], timeout=60) as gateway:
        http = gateway.info["http_address"]
        time.sleep(1.5)  # a health check has found it waiting for executors
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(3.5)  # the next one goes unanswered (2 s)
            health = httpx.get(http + "/health", timeout=10)
            start = time.monotonic()
            body = {"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 2}
            reply = httpx.post(http + "/v1/completions", json=body, timeout=60)
            waited = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert reply.status_code == 503 and waited < 5, (reply.text, waited)
