"""`weir bench serve`: online latency and throughput against a running server.

Requests arrive as a Poisson process at --request-rate (inf sends them all at
once), optionally capped at --max-concurrency in flight, and stream through
AsyncWeirClient (`--backend weir`, the scheduler's ZeroMQ address) or the
official `openai` client (`--backend openai --base-url URL`: any OpenAI-compatible
server, Weir's gateway included; token ids are sent as the prompt, and a stream's
token count comes from its usage record). Per request: TTFT (send to first token), ITL (gaps between
streamed token chunks), TPOT ((end - first token) / (output tokens - 1)) and
end-to-end latency. Goodput counts the requests per second that met every
given SLO.
"""

import argparse
import asyncio
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weir.services.bench.report import (
    append_markdown,
    check_output_paths,
    command_line,
    machine_info,
    plot_latency_cdfs,
    plot_throughput_over_time,
    serve_markdown,
    summarize,
    write_json,
)
from weir.services.bench.workload import (
    BenchRequest,
    add_workload_arguments,
    describe_workload,
    load_tokenizer,
    positive_int,
    workload_from_args,
)
from weir.shared.config import DEFAULT_ADDRESS, DEFAULT_HTTP_PORT

if TYPE_CHECKING:  # at run time imported where used (zmq only for --backend weir)
    from openai import AsyncOpenAI

    from weir.shared.client import AsyncWeirClient

_READY_POLL_S = 0.5
_DEFAULT_BASE_URL = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}/v1"


@dataclass(slots=True)
class RequestTrace:
    """What one request saw, in seconds since the benchmark started."""

    prompt_len: int
    output_len: int
    send_s: float
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.output_tokens > 0

    def finished_s(self) -> float:
        """end_s of a request that ended: the latencies are only asked of those."""
        if self.end_s is None:
            raise ValueError("the request has not finished")
        return self.end_s

    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.send_s

    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finished_s() - self.chunk_s[0]) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    def e2el_s(self) -> float:
        return self.finished_s() - self.send_s


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from start): all 0 for an infinite rate, else a seeded Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


async def _one_request(
    client: "AsyncWeirClient", request: BenchRequest, trace: RequestTrace, t0: float
) -> None:
    from weir.shared.sampling import SamplingParams

    params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
    try:
        async for out in client.generate(request.prompt_token_ids, params):
            now = time.perf_counter() - t0
            if out.new_token_ids:
                trace.chunk_s.append(now)
                trace.chunk_tokens.append(len(out.new_token_ids))
            if out.finished:
                trace.end_s = now
        if trace.end_s is None:
            trace.error = "stream ended before the request finished"
    except Exception as e:  # a failed request is a result to report, not a reason to stop the run
        trace.error = f"{type(e).__name__}: {e}"


async def _one_openai_request(
    client: "AsyncOpenAI", model: str, request: BenchRequest, trace: RequestTrace, t0: float
) -> None:
    try:
        stream = await client.completions.create(
            model=model,
            prompt=[request.prompt_token_ids],
            max_tokens=request.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter() - t0
            # Every chunk is a token, its text possibly empty (part of a character, or
            # held back as the start of a stop string), as vLLM's benchmark counts them.
            if chunk.choices:
                trace.chunk_s.append(now)
                trace.chunk_tokens.append(1)
            if chunk.usage is not None:
                # A chunk is a step's text; the usage record counts the tokens exactly.
                if trace.chunk_tokens:
                    trace.chunk_tokens[-1] += chunk.usage.completion_tokens - trace.output_tokens
                trace.end_s = now
        if trace.end_s is None:
            trace.error = "stream ended without its usage record"
    except Exception as e:  # a failed request is a result to report, not a reason to stop the run
        trace.error = f"{type(e).__name__}: {e}"


async def _wait_http_ready(base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    health = base_url.removesuffix("/").removesuffix("/v1") + "/health"
    async with httpx.AsyncClient() as http:
        while True:
            try:
                if (await http.get(health, timeout=5)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{health} not ready after {timeout_s:g} s")
            await asyncio.sleep(_READY_POLL_S)


@asynccontextmanager
async def _sender(
    backend: str, target: str, ready_timeout_s: float
) -> AsyncIterator[Callable[[BenchRequest, RequestTrace, float], Awaitable[None]]]:
    """``send(request, trace, t0)`` for the backend, once its server is ready."""
    if backend == "openai":
        import openai

        await _wait_http_ready(target, ready_timeout_s)
        api_key = os.environ.get("OPENAI_API_KEY") or "none"
        async with openai.AsyncOpenAI(base_url=target, api_key=api_key, max_retries=0) as client:
            try:
                model = (await client.models.list()).data[0].id
            except openai.APIError as exc:
                raise ConnectionError(
                    f"GET /models: {exc} (does --base-url end in /v1? an API key is read from "
                    "OPENAI_API_KEY)"
                ) from None
            yield lambda request, trace, t0: _one_openai_request(client, model, request, trace, t0)
        return
    from weir.shared.client import AsyncWeirClient

    async with AsyncWeirClient(target) as weir:
        await wait_until_ready(weir, ready_timeout_s)
        yield lambda request, trace, t0: _one_request(weir, request, trace, t0)


async def wait_until_ready(client: "AsyncWeirClient", timeout_s: float) -> None:
    """Poll health() until the server reports status "ok" (its executors are connected)."""
    from weir.shared.client import WeirError

    deadline = time.monotonic() + timeout_s
    while True:
        remaining = max(deadline - time.monotonic(), _READY_POLL_S)
        try:  # the client's own timeout may be longer than what is left
            status = (await asyncio.wait_for(client.health(), remaining)).get("status")
        except (WeirError, TimeoutError) as exc:
            status = f"no answer ({exc})" if str(exc) else "no answer"
        if status == "ok":
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"server not ready after {timeout_s:g} s (status {status!r})")
        await asyncio.sleep(_READY_POLL_S)


async def run_load(
    address: str,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool = True,
    ready_timeout_s: float = 60.0,
    backend: str = "weir",
) -> tuple[list[RequestTrace], float]:
    """Send the workload; returns one trace per request (in workload order) and the run's duration in seconds."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), request_rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _sender(backend, address, ready_timeout_s) as send:
        if requests:
            # Untimed, as vLLM's benchmark does: the first timed request would otherwise
            # carry the server's cold start (462 ms to its first token, against 182 typical).
            warmup = BenchRequest(requests[0].prompt_token_ids, 2)
            await send(
                warmup, RequestTrace(len(warmup.prompt_token_ids), 2, 0.0), time.perf_counter()
            )
        with tqdm(total=len(requests), desc="bench serve", unit="req", disable=not progress) as bar:
            t0 = time.perf_counter()

            async def launch(request: BenchRequest, offset: float) -> RequestTrace:
                await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
                if limit is not None:
                    await limit.acquire()
                trace = RequestTrace(
                    len(request.prompt_token_ids), request.output_len, time.perf_counter() - t0
                )
                try:
                    await send(request, trace, t0)
                finally:
                    if limit is not None:
                        limit.release()
                    bar.update(1)
                return trace

            # gather returns the traces in the order of its arguments: workload order.
            traces = await asyncio.gather(*(launch(r, o) for r, o in zip(requests, offsets)))
            duration = time.perf_counter() - t0
    return traces, duration


def summarize_run(
    traces: list[RequestTrace],
    duration_s: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> dict[str, Any]:
    ok = [t for t in traces if t.ok]
    ttft = [t.ttft_s() * 1e3 for t in ok]
    tpot = [v * 1e3 for t in ok if (v := t.tpot_s()) is not None]
    itl = [v * 1e3 for t in ok for v in t.itl_s()]
    e2el = [t.e2el_s() * 1e3 for t in ok]
    input_tokens = sum(t.prompt_len for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    if slo_ttft_ms is None and slo_tpot_ms is None:
        goodput = None
    else:
        good = sum(
            1
            for t in ok
            if (slo_ttft_ms is None or t.ttft_s() * 1e3 <= slo_ttft_ms)
            and (slo_tpot_ms is None or (t.tpot_s() or 0.0) * 1e3 <= slo_tpot_ms)
        )
        goodput = good / duration_s
    return {
        "completed": len(ok),
        "failed": len(traces) - len(ok),
        "errors": sorted({t.error for t in traces if t.error is not None})[:10],
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(t.output_len for t in traces),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "goodput": goodput,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "ttft_ms": summarize(ttft),
        "tpot_ms": summarize(tpot),
        "itl_ms": summarize(itl),
        "e2el_ms": summarize(e2el),
    }


def _plot(traces: list[RequestTrace], duration_s: float, plot_dir: Path) -> list[Path]:
    ok = [t for t in traces if t.ok]
    cdf_path = plot_dir / "latency_cdf.png"
    plot_latency_cdfs(
        {
            "TTFT": [t.ttft_s() * 1e3 for t in ok],
            "TPOT": [v * 1e3 for t in ok if (v := t.tpot_s()) is not None],
            "ITL": [v * 1e3 for t in ok for v in t.itl_s()],
            "End-to-end latency": [t.e2el_s() * 1e3 for t in ok],
        },
        cdf_path,
    )
    throughput_path = plot_dir / "throughput_over_time.png"
    token_times = [s for t in ok for s, n in zip(t.chunk_s, t.chunk_tokens) for _ in range(n)]
    plot_throughput_over_time(
        token_times, [(t.send_s, t.finished_s()) for t in ok], duration_s, throughput_path
    )
    return [cdf_path, throughput_path]


def add_serve_parser(
    bench_sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
) -> None:
    p = bench_sub.add_parser(
        "serve",
        help="online latency/throughput against a running server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend",
        choices=("weir", "openai"),
        default="weir",
        help="weir: the client SDK at --address; openai: an OpenAI-compatible server at --base-url",
    )
    p.add_argument(
        "--address",
        default=None,
        help=f"server address of --backend weir (default $WEIR_ADDRESS, else {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help=f"the OpenAI-compatible API of --backend openai (default {_DEFAULT_BASE_URL})",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the served model's HF dir or .gguf, for its tokenizer unless --tokenizer gives "
        "another (default: SmolLM2-135M-Instruct)",
    )
    add_workload_arguments(p, num_prompts=100)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (inf: all at once)",
    )
    g.add_argument(
        "--max-concurrency", type=positive_int, default=None, help="cap on requests in flight"
    )
    g.add_argument(
        "--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO for goodput"
    )
    g.add_argument(
        "--slo-tpot", type=float, default=None, metavar="MS", help="TPOT SLO for goodput"
    )
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="wait this long for the server to be ready",
    )
    g.add_argument("--no-progress", action="store_true", default=None, help="hide the progress bar")
    o = p.add_argument_group("output")
    o.add_argument(
        "--output-json",
        type=Path,
        default=None,
        help="write the summary and per-request traces here",
    )
    o.add_argument(
        "--plot-dir",
        type=Path,
        default=None,
        help="write latency_cdf.png and throughput_over_time.png",
    )
    o.add_argument(
        "--markdown", default=None, metavar="PATH", help="also append the markdown table to PATH"
    )
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from weir.shared.client import WeirError
    from weir.shared.model_store import resolve_model

    if not args.request_rate > 0:  # nan too
        print("error: --request-rate must be > 0", file=sys.stderr)
        return 2
    # The other backend's option would be ignored: the run would not measure what was meant.
    used, unused = ("base_url", "address") if args.backend == "openai" else ("address", "base_url")
    if getattr(args, unused) is not None:
        print(
            f"error: --{unused.replace('_', '-')} is not read by --backend {args.backend}, "
            f"which takes --{used.replace('_', '-')}",
            file=sys.stderr,
        )
        return 2
    if getattr(args, used) is None:
        # $WEIR_ADDRESS, as the other `weir` commands read it, here rather than as the flag's
        # default: the openai backend refuses an --address typed, not one in the environment.
        default = os.environ.get("WEIR_ADDRESS", DEFAULT_ADDRESS)
        setattr(args, used, _DEFAULT_BASE_URL if used == "base_url" else default)
    try:
        check_output_paths((args.output_json, args.markdown), (args.plot_dir,))
        requests = workload_from_args(
            args, load_tokenizer(args.tokenizer or resolve_model(args.model))
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        target = getattr(args, used)
        traces, duration = asyncio.run(
            run_load(
                target,
                requests,
                args.request_rate,
                args.max_concurrency,
                args.seed,
                progress=not args.no_progress,
                ready_timeout_s=args.ready_timeout,
                backend=args.backend,
            )
        )
    except (TimeoutError, WeirError, OSError) as e:
        print(f"error: {target}: {e}", file=sys.stderr)
        return 1
    command = command_line("weir bench serve", args)
    result = {
        "command": command,
        "machine": machine_info(None),
        "backend": args.backend,
        "address": target,
        "workload": describe_workload(requests, args),
        "num_prompts": len(requests),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
    } | summarize_run(traces, duration, args.slo_ttft, args.slo_tpot)
    table = serve_markdown(result, command)
    print(table)
    if args.markdown is not None:
        append_markdown(args.markdown, table)
    if args.plot_dir is not None:
        result["plots"] = [str(p) for p in _plot(traces, duration, args.plot_dir)]
    if args.output_json is not None:
        result["requests"] = [
            {
                "prompt_len": t.prompt_len,
                "output_len": t.output_len,
                "output_tokens": t.output_tokens,
                "send_s": t.send_s,
                "ttft_ms": t.ttft_s() * 1e3 if t.ok else None,
                "e2el_ms": t.e2el_s() * 1e3 if t.ok else None,
                "error": t.error,
            }
            for t in traces
        ]
        write_json(args.output_json, result)
    return 0 if result["failed"] == 0 else 1
