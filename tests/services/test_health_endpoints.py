"""Each role's metrics endpoint tells started from ready, as Kubernetes' probes read it.

Run apart, as Kubernetes runs them: the scheduler serves /metrics (started) but answers
/health with 503 until its executor joins; the executor's /health is 200 once welcomed.
Unknown paths are 404; --metrics-host is where /metrics and /health bind.
"""

import socket
import subprocess
import sys
import time

import httpx

from weir.shared.config import EXECUTOR, SCHEDULER, EngineArgs


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def _wait_status(url: str, want: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (status := _status(url)) != want:
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{url}: {status}, not {want}"
        time.sleep(0.2)


def test_started_ready_and_unknown_paths_of_roles_run_apart(tiny_model_dir, tmp_path):
    engine = EngineArgs(model=str(tiny_model_dir), kv_cache_memory="4MiB", device="cpu")
    metrics_host = "127.0.0.2"  # loopback too, but not the client socket's address
    scheduler_metrics = f"http://{metrics_host}:{_free_port(metrics_host)}"
    executor_metrics = f"http://127.0.0.1:{_free_port('127.0.0.1')}"
    executor_address = f"ipc://{tmp_path}/executor.sock"
    cli = [sys.executable, "-m", "weir.services.cli"]
    scheduler = subprocess.Popen(
        [
            *cli,
            SCHEDULER,
            "--port",
            str(_free_port("127.0.0.1")),
            "--metrics-host",
            metrics_host,
            "--metrics-port",
            scheduler_metrics.rpartition(":")[2],
            "--executor-address",
            executor_address,
            *engine.to_argv(SCHEDULER),
        ]
    )
    executor = None
    try:
        # Polled without pause from the start: its first answer is already the 503 of a
        # scheduler without executors (the endpoint once answered 500 in its first moments).
        deadline = time.monotonic() + 120
        while (status := _status(f"{scheduler_metrics}/health")) is None:
            assert scheduler.poll() is None and time.monotonic() < deadline
        assert status == 503
        _wait_status(f"{scheduler_metrics}/metrics", 200, scheduler)
        assert _status(f"{scheduler_metrics}/health") == 503  # started, no executor yet
        assert _status(f"{scheduler_metrics}/nope") == 404
        executor = subprocess.Popen(
            [
                *cli,
                EXECUTOR,
                "--scheduler",
                executor_address,
                "--metrics-port",
                executor_metrics.rpartition(":")[2],
                *engine.to_argv(EXECUTOR),
            ]
        )
        _wait_status(f"{executor_metrics}/health", 200, executor)
        _wait_status(f"{scheduler_metrics}/health", 200, scheduler)
        assert _status(f"{executor_metrics}/") == 404
        assert "weir_executor_num_kv_blocks" in httpx.get(f"{executor_metrics}/metrics").text
    finally:
        for proc in (executor, scheduler):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
