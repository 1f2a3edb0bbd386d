"""Benchmark results: records, percentile summaries, markdown tables, JSON files and PNG plots.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no display, no global state).
"""

import argparse
import json
import math
import os
import platform
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from weir.services.bench.workload import BenchRequest

if TYPE_CHECKING:  # matplotlib is imported only by the runs that plot
    from matplotlib.figure import Figure

PERCENTILES = (50, 90, 99)
# Namespace entries set by the CLI plumbing rather than by an option.
_NOT_OPTIONS = frozenset({"func", "command", "bench_command"})


@dataclass(slots=True)
class EngineRun:
    """One engine's pass over the workload in `bench throughput`.

    output_tokens counts each request's own output_len (the useful output);
    generated_tokens counts what the engine decoded, which is more for static
    batching, where a batch decodes up to its longest request.
    """

    engine: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    generated_tokens: int
    wall_s: float
    notes: str = ""

    @classmethod
    def from_outputs(
        cls,
        engine: str,
        requests: list[BenchRequest],
        output_lengths: list[int],
        wall_s: float,
        notes: str,
    ) -> "EngineRun":
        """A run whose engine returned ``output_lengths`` tokens, checked against each request's
        ``output_len`` so no engine is credited with tokens it did not produce."""
        for i, (length, r) in enumerate(zip(output_lengths, requests, strict=True)):
            if length != r.output_len:
                raise RuntimeError(
                    f"{engine} request {i} returned {length} tokens, expected {r.output_len}"
                )
        return cls(
            engine=engine,
            num_requests=len(requests),
            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            output_tokens=sum(output_lengths),
            generated_tokens=sum(output_lengths),
            wall_s=wall_s,
            notes=notes,
        )

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def machine_info(torch_threads: int | None) -> dict[str, Any]:
    """Where the numbers were measured; torch_threads is None when no engine ran in this process."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch_threads,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line(info: dict[str, Any]) -> str:
    parts = [f"{info['cpu']} ({info['cpu_count']} CPUs)"]
    if "gpu" in info:
        parts.append(info["gpu"])
    parts.append(f"torch {info['torch']}")
    if info["torch_threads"] is not None:
        parts.append(f"{info['torch_threads']} torch thread(s) per process")
    parts.append(info["platform"])
    return ", ".join(parts)


def command_line(prog: str, args: argparse.Namespace) -> str:
    """The command with every option spelled out, rebuilt from the parsed options (each --flag-name
    maps to args.flag_name), so a table shows the exact settings whichever way the run was started.
    False is a ``BooleanOptionalAction``'s ``--no-`` flag: the bench's plain flags default to
    None, not False."""
    words = prog.split()
    for dest, value in vars(args).items():
        if dest in _NOT_OPTIONS or value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True or value is False:
            words.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            words += [w for v in value for w in (flag, str(v))]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def summarize(values: list[float]) -> dict[str, float | None]:
    """Count, mean and percentiles; None for an empty series (for example ITL when every
    output is 1 token)."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "count": len(values),
        "mean": float(arr.mean()),
        **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES},
    }


def check_output_paths(
    files: tuple[str | Path | None, ...], folders: tuple[str | Path | None, ...] = ()
) -> None:
    """Refuse, before a run, a path its results could not be written to (OSError): a file
    that is a folder, a folder that is a file, or one under no writable folder."""
    paths = [(Path(p), False) for p in files if p] + [(Path(p), True) for p in folders if p]
    for path, folder in paths:
        if path.exists():  # replaced, or appended to (a markdown table)
            if path.is_dir() != folder:
                raise OSError(f"{path}: is {'not ' if folder else ''}a directory")
            if not os.access(path, os.W_OK):
                raise OSError(f"{path}: cannot be written")
            continue
        base = next(p for p in path.parents if p.exists())
        if not base.is_dir() or not os.access(base, os.W_OK):
            raise OSError(f"{path}: cannot be written ({base} is not a writable directory)")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def append_markdown(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n\n")


def throughput_markdown(
    runs: list[EngineRun], machine: dict[str, Any], command: str, workload: str, notes: list[str]
) -> str:
    weir = next((r for r in runs if r.engine == "weir"), None)
    lines = [
        f"Machine: {machine_line(machine)}",
        "",
        f"Command: `{command}`",
        "",
        f"Workload: {workload}",
        "",
        "| Engine | Requests/s | Output tok/s | Total tok/s | Wall (s) | Weir ÷ engine (output tok/s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ratio = (
            f"{weir.output_tokens_per_s / r.output_tokens_per_s:.2f}×"
            if weir is not None
            else "n/a"
        )
        lines.append(
            f"| {r.engine} | {r.requests_per_s:.3f} | {r.output_tokens_per_s:.1f} | {r.total_tokens_per_s:.1f} "
            f"| {r.wall_s:.2f} | {ratio} |"
        )
    lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def serve_markdown(result: dict[str, Any], command: str) -> str:
    lines = [
        f"Machine: {machine_line(result['machine'])}",
        "",
        f"Command: `{command}`",
        "",
        f"Workload: {result['workload']}; request rate {result['request_rate']}/s, "
        f"max concurrency {result['max_concurrency'] or 'unlimited'}",
        "",
        f"Requests: {result['completed']} completed, {result['failed']} failed in {result['duration_s']:.1f} s; "
        f"{result['request_throughput']:.3f} req/s, {result['output_throughput']:.1f} output tok/s"
        + ("" if result["goodput"] is None else f", goodput {result['goodput']:.3f} req/s"),
        "",
        *([f"Errors: {'; '.join(result['errors'])}", ""] if result["errors"] else []),
        "| Metric (ms) | Mean | P50 | P90 | P99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = result[name]
        cells = " | ".join(
            "n/a" if s[k] is None else f"{s[k]:.1f}" for k in ("mean", "p50", "p90", "p99")
        )
        lines.append(f"| {name.removesuffix('_ms').upper()} | {cells} |")
    return "\n".join(lines)


def _new_figure(width: float, height: float) -> "Figure":
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_latency_cdfs(series_ms: dict[str, list[float]], path: Path) -> None:
    """One empirical CDF panel per latency series (TTFT, TPOT, ITL, E2E)."""
    fig = _new_figure(10, 7)
    axes = fig.subplots(2, 2).flat
    for ax, (name, values) in zip(axes, series_ms.items()):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if values:
            xs = np.sort(np.asarray(values, dtype=np.float64))
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def plot_throughput_over_time(
    token_times_s: list[float],
    request_spans_s: list[tuple[float, float]],
    duration_s: float,
    path: Path,
) -> None:
    """Output tokens/s in up to 60 time buckets (at least 0.1 s wide), and requests in flight."""
    num_buckets = max(1, min(60, math.ceil(duration_s / 0.1)))
    edges = np.linspace(0.0, max(duration_s, 1e-9), num_buckets + 1)
    tokens, _ = np.histogram(token_times_s, bins=edges)
    events = sorted(
        [(start, 1) for start, _ in request_spans_s] + [(end, -1) for _, end in request_spans_s]
    )
    times = [0.0] + [t for t, _ in events]
    in_flight = np.concatenate([[0], np.cumsum([d for _, d in events])])
    fig = _new_figure(10, 6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(edges[:-1], tokens / (edges[1] - edges[0]), width=edges[1] - edges[0], align="edge")
    top.set_ylabel("output tokens/s")
    top.grid(alpha=0.3)
    bottom.step(times, in_flight, where="post", color="tab:orange")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds since start")
    bottom.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
