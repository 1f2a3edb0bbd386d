"""Tensor parallelism through the serving path: `LLM(tensor_parallel_size=2)` starts a
scheduler and two executor ranks that form one gloo group and answer like one process."""

import os
import signal
import subprocess
import sys
import time

import pytest
from serving_helpers import hf_greedy

from weir.services import LLM
from weir.services.launcher import (
    ChildFailedError,
    ServerProcesses,
    free_port,
    resolve_num_executors,
)
from weir.shared.client import WeirClient
from weir.shared.config import EngineArgs
from weir.shared.sampling import SamplingParams


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_two_ranks_serve_greedy_like_one_process_and_restart_together(
    tiny_model_dir, tiny_hf_model
):
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [42] * 9]
    lengths = (6, 9, 4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    with LLM(
        str(tiny_model_dir),
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        kv_cache_memory="1MiB",
    ) as llm:
        executors = llm.server_info["executors"]
        assert [e["rank"] for e in executors] == [0, 1]
        completions = llm.generate(prompts, params)
        for prompt, n, c in zip(prompts, lengths, completions):
            assert c.token_ids == hf_greedy(tiny_hf_model, prompt, n)

        # A rank that dies takes the group with it; the supervisor starts both ranks again
        # and the request waits for the new group instead of failing.
        os.kill(executors[1]["pid"], signal.SIGKILL)
        again = llm.generate([prompts[1]], [params[1]])[0]
        assert again.token_ids == hf_greedy(tiny_hf_model, prompts[1], lengths[1])
        assert _gone(executors[0]["pid"]) and _gone(executors[1]["pid"])


def test_a_model_whose_heads_do_not_split_is_refused_at_start_up(default_model_dir):
    with pytest.raises(ChildFailedError) as refused:
        LLM(str(default_model_dir), tensor_parallel_size=2, startup_timeout=120)
    message = str(refused.value)
    assert "\n" not in message
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in message


def test_a_scheduler_alone_refuses_such_a_group_before_waiting_for_it(default_model_dir):
    """As Kubernetes runs it (no supervisor): it would otherwise wait for ranks that fail."""
    scheduler = subprocess.run(
        [sys.executable, "-m", "weir.services.cli", "scheduler", "--model", str(default_model_dir)]
        + ["--tensor-parallel-size", "2", "--port", "0", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert scheduler.returncode == 2
    assert scheduler.stderr.strip() == (
        "weir scheduler: --tensor-parallel-size 2 does not divide the model's 9 attention heads"
    )


def test_a_rank_waiting_for_its_group_stops_at_sigterm(default_model_dir):
    """Waiting in torch's rendezvous (C++) a Python SIGTERM handler never ran: a pod being
    deleted stayed for its whole grace period, a process for 10 minutes."""
    ports = [free_port(), free_port()]
    rank = subprocess.Popen(
        [sys.executable, "-m", "weir.services.cli", "executor", "--rank", "1"]
        + ["--scheduler", f"tcp://127.0.0.1:{ports[0]}", "--model", str(default_model_dir)]
        + ["--tensor-parallel-size", "3", "--device", "cpu", "--threads", "1"],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[1])},
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(5)  # rank 0 never comes: it waits for the group
        assert rank.poll() is None
        rank.send_signal(signal.SIGTERM)
        rank.wait(timeout=15)
    finally:
        rank.kill()
        rank.wait()


def test_the_group_size_is_the_number_of_executors():
    assert resolve_num_executors(None, EngineArgs()) == 1
    assert resolve_num_executors(None, EngineArgs(tensor_parallel_size=3)) == 3
    assert resolve_num_executors(2, EngineArgs()) == 2  # replicas of the whole model
    with pytest.raises(ValueError, match="num_executors 2 != tensor_parallel_size 3"):
        resolve_num_executors(2, EngineArgs(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineArgs(tensor_parallel_size=0)


def test_two_executors_without_tensor_parallelism_are_replicas_of_the_whole_model(
    tiny_model_dir, tiny_hf_model
):
    engine = EngineArgs(model=str(tiny_model_dir), kv_cache_memory="1MiB", threads=1)
    with ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, num_executors=2
    ) as server:
        assert [e["rank"] for e in server.info["executors"]] == [0, 1]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        with WeirClient(server.client_address) as client:
            tokens = [t for o in client.generate([5, 6, 7, 8], params) for t in o.new_token_ids]
        assert tokens == hf_greedy(tiny_hf_model, [5, 6, 7, 8], 8)


@pytest.mark.parametrize("killed", [0, 1])
def test_a_rank_killed_mid_stream_loses_the_group_not_the_request(
    tiny_model_dir, tiny_hf_model, killed
):
    """The surviving rank's collective fails first (gloo: connection reset). That is the
    group's failure, not the request's: it must not be blamed (with one request in the
    step, the bisection ended it at once) but wait for the new group and finish."""
    engine = EngineArgs(
        model=str(tiny_model_dir),
        tensor_parallel_size=2,
        kv_cache_memory="1MiB",
        threads=1,
        async_scheduling=False,  # in lockstep the failure is always inside a step
    )
    prompt, n = [5, 6, 7, 8], 80  # the rank is killed after 20
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with ServerProcesses(engine, port=0, metrics_port=0, executor_metrics_port=0) as server:
        pids = [e["pid"] for e in server.info["executors"]]
        with WeirClient(server.client_address, timeout=120) as client:
            tokens: list[int] = []
            for out in client.generate(prompt, params):
                tokens += out.new_token_ids
                if len(tokens) >= 20 and not _gone(pids[killed]):
                    # Stopped first, so the other rank is surely inside a collective of
                    # the next step (sent already) when the kill resets its connection.
                    os.kill(pids[killed], signal.SIGSTOP)
                    time.sleep(0.5)
                    os.kill(pids[killed], signal.SIGKILL)
        assert tokens == hf_greedy(tiny_hf_model, prompt, n)
