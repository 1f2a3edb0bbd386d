"""TPOT and TTFT through the HTTP gateway against the SDK path, on one server, with the
executor on a core of its own.

Issue 12's floors compare the gateway with the SDK at 32 concurrent streams. On a
machine where the client and the gateway take CPU from the executor, the comparison
measures that contention, not the gateway. So this script pins the executor (all its
threads, ``--threads 1``) to the last core, and the scheduler, the gateway and the
clients to the others, then runs ``weir bench serve`` alternately through the SDK
(``--backend weir``) and the official ``openai`` client (``--backend openai``).

    .venv/bin/python benchmarks/gateway_overhead.py [--pairs 3 --num-prompts 64 --concurrency 32]

Needs at least 2 cores. Prefix caching is off so that every run does the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from weir.services.launcher import ServerProcesses
from weir.shared.config import EXECUTOR, EngineArgs


def _children() -> list[int]:
    return [
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]


def _pin(pid: int, cores: set[int]) -> None:
    for thread in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(thread.name), cores)


def _role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[3].decode() if len(argv) > 3 else ""


def _bench(args: argparse.Namespace, backend: str, server: ServerProcesses, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "weir.services.cli",
        "bench",
        "serve",
        "--backend",
        backend,
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--no-progress",
        "--output-json",
        str(out),
    ]
    if backend == "weir":
        cmd += ["--address", server.client_address]
    else:
        cmd += ["--base-url", server.info["http_address"] + "/v1"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs at least 2 cores")
    executor_cores, other_cores = {cores[-1]}, set(cores[:-1])
    engine_args = EngineArgs(threads=1, enable_prefix_caching=False)
    with ServerProcesses(
        engine_args, port=0, metrics_port=0, executor_metrics_port=0, http_port=0
    ) as server:
        for child in _children():
            _pin(child, executor_cores if _role(child) == EXECUTOR else other_cores)
        os.sched_setaffinity(0, other_cores)  # the bench clients inherit it
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for pair in range(args.pairs):
                for backend in ("weir", "openai"):
                    s = _bench(args, backend, server, Path(tmp, f"{backend}-{pair}.json"))
                    rows.append((backend, pair + 1, s))
    print(f"executor on core {cores[-1]}; scheduler, gateway and clients on {sorted(other_cores)}")
    print("| path | run | TPOT mean ms | TPOT p50 ms | TTFT mean ms | TTFT p50 ms | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for backend, run, s in rows:
        path = "SDK" if backend == "weir" else "gateway"
        print(
            f"| {path} | {run} | {s['tpot_ms']['mean']:.1f} | {s['tpot_ms']['p50']:.1f} | "
            f"{s['ttft_ms']['mean']:.1f} | {s['ttft_ms']['p50']:.1f} | "
            f"{s['output_throughput']:.1f} |"
        )
    ratios = [
        rows[i + 1][2]["tpot_ms"]["mean"] / rows[i][2]["tpot_ms"]["mean"]
        for i in range(0, len(rows), 2)
    ]
    ttft = [
        rows[i + 1][2]["ttft_ms"]["mean"] - rows[i][2]["ttft_ms"]["mean"]
        for i in range(0, len(rows), 2)
    ]
    print(
        f"gateway / SDK TPOT mean per pair: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.3f}); gateway - SDK TTFT mean per pair ms: "
        f"{', '.join(f'{d:+.1f}' for d in ttft)}"
    )


if __name__ == "__main__":
    main()
