"""CurveZMQ: only holders of the keys reach the scheduler (real processes, real sockets).

One `weir serve`-like server (scheduler, a real executor on the default model, the HTTP
gateway) runs with keys made by `weir keys`; clients with and without the client key,
and rogue executors with no key, an unknown key or the client key, try to reach it.
"""

import json
import os
import select
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import zmq

from weir.services.launcher import ServerProcesses
from weir.shared.client import ServerUnavailableError, WeirClient
from weir.shared.config import EngineArgs
from weir.shared.keys import KEYS_DIR_ENV, load_pair, load_public, make_keys
from weir.shared.protocol import control
from weir.shared.sampling import SamplingParams

WEIR = [sys.executable, "-m", "weir.services.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop(KEYS_DIR_ENV, None)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KEY_FILES = {f"{n}.{e}" for n in ("cluster", "server", "client") for e in ("key", "key_secret")}


@pytest.fixture(autouse=True)
def no_keys_in_environment(monkeypatch):
    monkeypatch.delenv(KEYS_DIR_ENV, raising=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("auth") / "keys"
    subprocess.run([*WEIR, "keys", str(directory)], check=True, env=ENV, timeout=60)
    return directory


@pytest.fixture(scope="module")
def server(keys):
    args = EngineArgs(keys_dir=str(keys), kv_cache_memory="64MiB", max_model_len=1024)
    with ServerProcesses(
        args, port=0, metrics_port=0, executor_metrics_port=0, http_port=0
    ) as server:
        yield server


def generated(client: WeirClient, prompt: str = "The capital of France is") -> list[int]:
    return [t for out in client.generate(prompt, GREEDY) for t in out.new_token_ids]


def test_weir_keys_writes_private_secrets_and_keeps_existing_keys(tmp_path):
    directory = tmp_path / "keys"
    out = subprocess.run(
        [*WEIR, "keys", str(directory)], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "executor:  cluster.key_secret" in out.stdout
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {p.name for p in directory.iterdir()} == KEY_FILES
    for path in directory.iterdir():
        want = 0o600 if path.name.endswith("_secret") else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == want, path.name
    pairs = [load_pair(directory, n) for n in ("cluster", "server", "client")]
    assert len({p.secret for p in pairs}) == 3
    assert [load_public(directory, n) for n in ("cluster", "server", "client")] == [
        p.public for p in pairs
    ]
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    again = subprocess.run(
        [*WEIR, "keys", str(directory)], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert again.returncode == 1 and "already holds" in again.stderr
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_clients_holding_the_key_are_served(server, keys, monkeypatch):
    with WeirClient(server.client_address, keys_dir=keys, timeout=120) as client:
        assert client.health()["status"] == "ok"
        assert len(generated(client)) == 6
    monkeypatch.setenv(KEYS_DIR_ENV, str(keys))  # the SDK's default
    with WeirClient(server.client_address, timeout=120) as client:
        assert len(generated(client)) == 6
    # The gateway got the keys from the launcher.
    request = urllib.request.Request(
        f"{server.info['http_address']}/v1/completions",
        data=json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] == 4


class _Relay:
    """A TCP relay that records every byte passing between a client and the scheduler."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.seen = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._upstream)
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(65536):
            self.seen += data
            dst.sendall(data)
        dst.close()

    def close(self) -> None:
        self._listener.close()


def test_prompts_and_outputs_are_encrypted_on_the_wire(server, keys):
    relay = _Relay(server.client_address)
    try:
        with WeirClient(relay.address, keys_dir=keys, timeout=120) as client:
            outs = list(client.generate("The password is PINEAPPLE-42. Repeat it:", GREEDY))
        text = "".join(o.text for o in outs)
        assert len(relay.seen) > 1000 and sum(len(o.new_token_ids) for o in outs) == 6
        for plain in filter(None, (b"PINEAPPLE", b"password", text.strip().encode(), b"generate")):
            assert plain not in relay.seen, plain
    finally:
        relay.close()


def test_model_info_reveals_no_pid_address_or_configuration(server, keys):
    with WeirClient(server.client_address, keys_dir=keys, timeout=120) as client:
        info = client.model_info()
    assert info["model_name"] == "SmolLM2-135M-Instruct"
    assert info["max_model_len"] == 1024 and info["vocab_size"] == 49152
    text = json.dumps(info)
    assert "pid" not in text and "address" not in text and "://" not in text
    assert "executors" not in info and "scheduler_config" not in info
    pids = {server.info["pid"], *(e["pid"] for e in server.info["executors"])}
    assert not pids & {v for v in info.values() if isinstance(v, int)}


def test_clients_without_the_key_get_a_clear_error_not_an_answer(server, keys, tmp_path):
    # The timeouts are long: the errors below are the server's refusal, not a timeout.
    with WeirClient(server.client_address, timeout=120) as keyless:
        with pytest.raises(ServerUnavailableError, match="disagree on encryption"):
            generated(keyless)
        with pytest.raises(ServerUnavailableError, match="disagree on encryption"):
            keyless.health()
    # A client key the server never issued, with the right server key.
    impostor = tmp_path / "impostor"
    make_keys(impostor)
    (impostor / "server.key").unlink()
    (impostor / "server.key").write_bytes((keys / "server.key").read_bytes())
    with WeirClient(server.client_address, keys_dir=impostor, timeout=120) as client:
        with pytest.raises(ServerUnavailableError, match="refused this client's CurveZMQ key"):
            client.model_info()
    # The wrong server key: the handshake cannot finish, so the client times out.
    (impostor / "server.key").unlink()
    (impostor / "server.key").write_bytes((impostor / "cluster.key").read_bytes())
    with WeirClient(server.client_address, keys_dir=impostor, timeout=2) as client:
        with pytest.raises(
            ServerUnavailableError, match="no reply .* or it does not accept the keys"
        ):
            client.health()
    with WeirClient(server.client_address, keys_dir=keys, timeout=120) as client:
        assert client.health()["status"] == "ok"


def _rogue(ctx: zmq.Context, address: str, own=None, server_key: bytes | None = None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if own is not None:
        sock.curve_publickey, sock.curve_secretkey = own
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


def test_rogue_executors_never_reach_the_handshake(server, keys):
    real = server.info["executors"][0]
    # As valid-looking as it gets: the real executor's own hello, another session.
    hello = control.ExecutorHello(
        session=uuid.uuid4().hex,
        rank=0,
        pid=os.getpid(),
        model_name=real["model"],
        vocab_size=49152,
        num_blocks=real["num_blocks"],
        block_size=16,
        max_num_batched_tokens=EngineArgs().step_limits[0],
        max_num_seqs=EngineArgs().step_limits[1],
        max_model_len=real["max_model_len"],
        eos_token_ids=real["eos_token_ids"],
        dtype=real["dtype"],
        device=real["device"],
        attention_backend=real["attention_backend"],
    )
    frames = [control.HELLO, control.pack(hello)]
    beat = [control.HEARTBEAT, control.pack(control.Heartbeat(hello.session, 0))]
    address = server.info["executor_address"]
    cluster_public = load_public(keys, "cluster")
    unknown = zmq.curve_keypair()
    client = load_pair(keys, "client")
    ctx = zmq.Context()
    try:
        rogues = {
            "no key": _rogue(ctx, address),
            "an unknown key": _rogue(ctx, address, unknown, cluster_public),
            "the client key": _rogue(ctx, address, (client.public, client.secret), cluster_public),
        }
        for sock in rogues.values():
            sock.send_multipart(frames)
            sock.send_multipart(beat)
        # Any hello that reached the scheduler is answered (welcome or reject), any
        # heartbeat of an unknown session with reset: silence means it never got there.
        # Listened to together: each rogue gets the same 3 s of silence, not one after another.
        poller = zmq.Poller()
        for sock in rogues.values():
            poller.register(sock, zmq.POLLIN)
        answered = dict(poller.poll(3000))
        for name, sock in rogues.items():
            assert sock not in answered, f"a rogue executor with {name} got an answer"
        cluster = load_pair(keys, "cluster")
        holder = _rogue(ctx, address, (cluster.public, cluster.secret), cluster_public)
        holder.send_multipart(frames)
        assert holder.poll(60_000), "the same hello with the cluster key got no answer"
        kind, body = holder.recv_multipart()
        assert kind == control.REJECT and b"already served" in body
    finally:
        ctx.destroy(linger=0)
    with WeirClient(server.client_address, keys_dir=keys, timeout=120) as client_:
        assert client_.health()["executors"] == [0]
        assert len(generated(client_)) == 6


def _executor_argv(server, *extra: str) -> list[str]:
    argv = [*WEIR, "executor", "--scheduler", server.info["executor_address"]]
    return argv + ["--metrics-port", "0", "--kv-cache-memory", "16MiB", *extra]


def test_a_real_executor_without_keys_exits_with_the_reason(server, keys):
    out = subprocess.run(
        _executor_argv(server), capture_output=True, text=True, env=ENV, timeout=180
    )
    assert out.returncode == 1 and "disagree on encryption" in out.stderr, out.stderr
    with WeirClient(server.client_address, keys_dir=keys, timeout=120) as client:
        assert client.health()["executors"] == [0]


def test_a_real_executor_with_another_cluster_key_never_joins_and_says_why(server, keys, tmp_path):
    make_keys(tmp_path / "other")
    executor = subprocess.Popen(
        _executor_argv(server, "--keys-dir", str(tmp_path / "other")),
        stderr=subprocess.PIPE,
        env=ENV,
    )
    try:
        # It pins its own cluster key as the server's: the scheduler cannot decrypt its
        # handshake and closes each connection; the executor keeps trying and says why.
        deadline, log = time.monotonic() + 180, b""
        while b"dropped" not in log and time.monotonic() < deadline:
            if select.select([executor.stderr], [], [], 1)[0]:
                log += os.read(executor.stderr.fileno(), 65536)
        assert b"cluster key is probably not the scheduler's" in log, log
        assert executor.poll() is None
        with WeirClient(server.client_address, keys_dir=keys, timeout=120) as client:
            assert client.health()["executors"] == [0]
            assert len(generated(client)) == 6
    finally:
        executor.kill()
        executor.wait()


def test_a_scheduler_whose_keys_are_missing_says_which_file(tmp_path):
    out = subprocess.run(
        [*WEIR, "scheduler", "--port", "0", "--metrics-port", "0", "--keys-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 2
    assert "has no cluster.key_secret" in out.stderr and "weir keys" in out.stderr
