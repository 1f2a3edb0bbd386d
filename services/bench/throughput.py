"""`weir bench throughput`: offline throughput of Weir's LLM API against Hugging Face and
llama.cpp baselines.

Every engine gets the same token-id prompts and output lengths, greedy decoding
with EOS ignored, and the same number of threads (default: what Weir's executor takes
at its defaults, see ``weir.services.cpu_cores``; with tensor parallelism a baseline
gets as many as Weir's executors together). Timing covers
generation only: model loading and one short warmup request are excluded.
"""

import argparse
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from weir.services.bench.report import (
    EngineRun,
    append_markdown,
    check_output_paths,
    command_line,
    machine_info,
    throughput_markdown,
    write_json,
)
from weir.services.bench.workload import (
    WARMUP_PROMPT,
    BenchRequest,
    add_workload_arguments,
    describe_workload,
    load_tokenizer,
    non_negative_int,
    positive_int,
    workload_from_args,
)
from weir.shared.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    EngineArgs,
    parse_size,
)

BASELINE_CHOICES = ("hf-static", "hf-cb", "llama-cpp", "none")
DTYPES = ("float32", "bfloat16", "float16")
# transformers' continuous batching gets Weir's step budget unless one is given.


def _baselines(values: list[str] | None) -> list[str]:
    """--baseline may repeat and take comma lists; 'none' alone means no baseline."""
    chosen: list[str] = []
    for value in values or []:
        for name in filter(None, (v.strip() for v in value.split(","))):
            if name not in BASELINE_CHOICES:
                raise argparse.ArgumentTypeError(
                    f"unknown baseline {name!r}; choose from {BASELINE_CHOICES}"
                )
            if name != "none" and name not in chosen:
                chosen.append(name)
    return chosen


def add_throughput_parser(
    bench_sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
) -> None:
    p = bench_sub.add_parser(
        "throughput",
        help="offline throughput of the LLM API, optionally against Hugging Face baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="dummy: random weights of the model's shape, for every engine (a model directory "
        "with config.json and a tokenizer suffices)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weights/activations dtype for every engine",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads per process for every engine (default: the threads Weir's executor takes "
        "at its defaults: the cores available, less one for the scheduler from 4 cores up; "
        "OMP_NUM_THREADS does not count). Without it Weir runs exactly as `LLM()` does, pinning "
        "included",
    )
    add_workload_arguments(p, num_prompts=64)
    g = p.add_argument_group("engines")
    g.add_argument(
        "--baseline",
        action="append",
        metavar="NAME[,NAME]",
        help="hf-static, hf-cb, llama-cpp or none; repeat or comma-separate to run several "
        "(default: none). llama-cpp needs llama-cpp-python and a GGUF file; it is skipped with "
        "a message otherwise",
    )
    g.add_argument(
        "--llama-cpp-gguf",
        type=Path,
        default=None,
        help="GGUF file of the llama-cpp baseline (default: --model when it is a .gguf, else the "
        "default model's GGUF, the file Weir converts)",
    )
    g.add_argument(
        "--no-weir", action="store_true", default=None, help="measure only the baselines"
    )
    g.add_argument(
        "--disable-detokenize",
        action="store_true",
        default=None,
        help="vLLM's: Weir returns token ids without text (SamplingParams.detokenize=False), as "
        "the Hugging Face baselines do",
    )
    g.add_argument(
        "--hf-batch-size",
        type=positive_int,
        default=16,
        help="batch size of the hf-static baseline",
    )
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help="Weir engine option (default: as LLM sets it for the machine's device)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="Weir engine option; also hf-cb's max_batch_tokens and llama-cpp's prefill batch "
        "(default: as LLM sets it for the machine's device: 2048 on a CPU, vLLM's on CUDA)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="Weir engine option (KV cache size, e.g. 512MiB)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="Weir engine option: fp8 keeps one byte a cached value (default: auto, the model's)",
    )
    g.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="Weir engine option: keep Weir's weights quantized (int8: weight-only, per output "
        "channel; the baselines keep --dtype)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='Weir engine option, vLLM\'s: {"method": "ngram", "num_speculative_tokens": 3} or '
        '{"model": DIR, "num_speculative_tokens": 3} (a draft model)',
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=None,
        help="Weir engine option: executor ranks sharing the model (each gets --threads, by "
        "default its share of the cores)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Weir engine option: plan step N+1 while step N runs (default: on)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="Weir engine option: no CUDA graphs (default: steps replay them on CUDA)",
    )
    g.add_argument(
        "--max-mixed-graph-tokens",
        type=non_negative_int,
        default=None,
        help="Weir engine option: the largest mixed step replayed from a CUDA graph (default "
        "8192; 0: decode steps only)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--output-json", type=Path, default=None, help="write the results as JSON here")
    o.add_argument(
        "--markdown",
        default=None,
        metavar="PATH",
        help="also append the markdown table to PATH (it is always printed)",
    )
    p.set_defaults(func=run_throughput)


def _step_limits(args: argparse.Namespace) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of this run: as given, else as ``LLM`` sets them
    on this machine; the baselines' budget too."""
    from weir.services.launcher import with_device_step_limits

    given = EngineArgs(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
    )
    return with_device_step_limits(given, offline=True).step_limits


def _engine_options(args: argparse.Namespace, step_limits: tuple[int, int]) -> dict[str, Any]:
    options = {
        "load_format": None if args.load_format == "auto" else args.load_format,
        "max_num_batched_tokens": step_limits[0],
        "max_num_seqs": step_limits[1],
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "speculative_config": args.speculative_config,
        "tensor_parallel_size": args.tensor_parallel_size,
        "async_scheduling": args.async_scheduling,
        "enforce_eager": args.enforce_eager,
        "max_mixed_graph_tokens": args.max_mixed_graph_tokens,
        "tokenizer": args.tokenizer,
    }
    return {k: v for k, v in options.items() if v is not None}


def run_weir(
    requests: list[BenchRequest],
    model_dir: Path,
    dtype: str,
    threads: int | None,
    engine_options: dict[str, Any],
    detokenize: bool = True,
) -> tuple[EngineRun, float]:
    """Weir's run, and the Triton kernel variants its executors compiled during it."""
    from weir.services.llm import LLM
    from weir.shared.sampling import SamplingParams

    with LLM(model=str(model_dir), dtype=dtype, threads=threads, **engine_options) as llm:
        llm.generate(
            [list(WARMUP_PROMPT)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        )
        params = [
            SamplingParams(
                max_tokens=r.output_len, temperature=0.0, ignore_eos=True, detokenize=detokenize
            )
            for r in requests
        ]
        compiled_before = _kernel_compiles(llm.server_info)
        start = time.perf_counter()
        completions = llm.generate([r.prompt_token_ids for r in requests], params)
        wall = time.perf_counter() - start
        compiled = _kernel_compiles(llm.server_info) - compiled_before
    options = ", ".join(
        f"{k}={v}" for k, v in {**engine_options, "threads": threads or "default"}.items()
    )
    if not detokenize:
        options += ", no detokenization"
    run = EngineRun.from_outputs(
        "weir", requests, [len(c.token_ids) for c in completions], wall, f"LLM.generate, {options}"
    )
    return run, compiled


def _kernel_compiles(server_info: dict[str, Any]) -> float:
    """Triton kernel variants the executors compiled since they started serving (their
    weir_executor_kernel_compiles_total): each one stalled the batch, inside the wall time."""
    total = 0.0
    for executor in server_info["executors"]:
        if executor.get("metrics_address") is None:
            continue
        with urllib.request.urlopen(executor["metrics_address"], timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            total += sum(
                s.value for s in family.samples if s.name == "weir_executor_kernel_compiles_total"
            )
    return total


def _run_baselines(
    names: list[str],
    requests: list[BenchRequest],
    model_dir: Path,
    threads: int,
    args: argparse.Namespace,
    budget: int,
) -> list[EngineRun]:
    import torch

    from weir.services.bench.baselines import load_hf_model, run_hf_continuous, run_hf_static

    runs = []
    hf_names = [n for n in names if n.startswith("hf-")]
    if hf_names:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = load_hf_model(model_dir, args.dtype, device, args.load_format)
        for name in hf_names:
            _status(f"running {name} on {len(requests)} requests")
            if name == "hf-static":
                runs.append(run_hf_static(model, requests, args.hf_batch_size))
            else:
                runs.append(run_hf_continuous(model, requests, budget))
        del model
    if "llama-cpp" in names:
        from weir.services.bench import llama_cpp_baseline

        gguf = _llama_cpp_gguf(args)
        reason = llama_cpp_baseline.missing_reason(gguf)
        if reason is not None:
            _status(f"skipping the llama-cpp baseline: {reason}")
        else:
            assert gguf is not None
            _status(f"running llama-cpp on {len(requests)} requests ({gguf.name})")
            runs.append(llama_cpp_baseline.run_llama_cpp(gguf, requests, threads, budget))
    return runs


def _llama_cpp_gguf(args: argparse.Namespace) -> Path | None:
    """The GGUF the llama-cpp baseline loads: the one Weir converts, unless told otherwise."""
    from weir.shared.model_store import default_gguf_path

    if args.llama_cpp_gguf is not None:
        return Path(args.llama_cpp_gguf)
    if args.model is None:
        return default_gguf_path()
    return Path(args.model) if str(args.model).endswith(".gguf") else None


def _status(message: str) -> None:
    print(f"[bench throughput] {message}", file=sys.stderr, flush=True)


def _set_threads(threads: int | None, num_executors: int) -> tuple[int, int]:
    """(threads of each Weir executor, threads of each baseline): ``threads``, else what
    each executor gets at its defaults; a baseline (this process, for the HF ones) gets
    as many as all of Weir's executors together, one per tensor-parallel rank."""
    import torch

    from weir.services.cpu_cores import available_cpus, plan_cpus

    if threads is None:
        threads = plan_cpus(available_cpus(), num_executors).executor_threads
    torch.set_num_threads(threads * num_executors)
    return threads, threads * num_executors


def _ratios(runs: list[EngineRun]) -> dict[str, float]:
    weir = next((r for r in runs if r.engine == "weir"), None)
    if weir is None:
        return {}
    return {
        f"weir/{r.engine}": weir.output_tokens_per_s / r.output_tokens_per_s
        for r in runs
        if r.engine != "weir"
    }


def run_throughput(args: argparse.Namespace) -> int:
    from weir.shared.client import WeirError
    from weir.shared.model_store import resolve_model

    try:
        baselines = _baselines(args.baseline)
    except argparse.ArgumentTypeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.no_weir and not baselines:
        print("error: --no-weir needs at least one --baseline", file=sys.stderr)
        return 2
    num_executors = args.tensor_parallel_size or 1
    threads, baseline_threads = _set_threads(args.threads, num_executors)
    step_limits = _step_limits(args)
    try:
        check_output_paths((args.output_json, args.markdown))
        model_dir = resolve_model(
            args.model, load_format=args.load_format, tokenizer=args.tokenizer
        )
        requests = workload_from_args(args, load_tokenizer(args.tokenizer or model_dir))
        if not args.no_weir:  # refused now, not after the workload and the model loaded
            EngineArgs(model=str(model_dir), **_engine_options(args, step_limits))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workload = describe_workload(requests, args)
    _status(workload)

    runs: list[EngineRun] = []
    if not args.no_weir:
        _status(f"running weir on {len(requests)} requests")
        try:
            run, compiled = run_weir(
                requests,
                model_dir,
                args.dtype,
                args.threads,
                _engine_options(args, step_limits),
                detokenize=not args.disable_detokenize,
            )
        except WeirError as e:  # a request the engine refused (a prompt past its context...)
            print(f"error: weir: {e}", file=sys.stderr)
            return 1
        runs.append(run)
    if baselines:
        runs += _run_baselines(
            baselines, requests, model_dir, baseline_threads, args, step_limits[0]
        )
    if not runs:
        print("error: no engine could run (see the messages above)", file=sys.stderr)
        return 2

    machine = machine_info(baseline_threads if baselines else None)
    command = command_line("weir bench throughput", args)
    notes = [
        f"Model {model_dir.name}, {args.dtype}"
        + (f" (Weir: {args.quantization} weights)" if args.quantization else "")
        + "; every engine gets the same token ids and output lengths, greedy, EOS ignored.",
        f"threads: {baseline_threads} per baseline (the HF baselines' process via "
        "torch.set_num_threads, llama.cpp via n_threads and n_threads_batch); Weir "
        + (
            f"{num_executors} executors (tensor-parallel ranks) of {threads}"
            if num_executors > 1
            else f"{threads} in its executor"
        )
        + (
            f" (--threads {threads}). "
            if args.threads
            else " (its defaults, pinned cores where its plan pins them). "
        )
        + "Weir also runs a scheduler process (one thread) next to its executor.",
        "Wall time covers generation only: model load and one 2-token warmup request are excluded.",
        "Output tok/s counts each request's own output_len.",
    ]
    if not args.no_weir:
        notes.append(
            f"Triton kernel variants Weir's executors compiled during the timed run: {compiled:.0f} "
            "(weir_executor_kernel_compiles_total; each stalls the batch, and the start-up "
            "warm-up compiles every variant a step can launch)."
        )
    if "hf-static" in baselines:
        notes.append(
            f"hf-static: batches of {args.hf_batch_size} in request order, left padded; each batch decodes to its "
            "longest output_len and the extra tokens are not counted as output."
        )
    if "hf-cb" in baselines:
        notes.append(
            "hf-cb: transformers' continuous batching manager (what generate_batch runs), each request with its own "
            f"max_new_tokens, max_batch_tokens {step_limits[0]}, "
            "KV cache sized to hold every request at once."
        )
    if any(r.engine == "llama-cpp" for r in runs):
        notes.append(
            "llama-cpp: llama-cpp-python's C API, every request its own sequence in one unified KV "
            "cache; prompts prefilled in batches of max_num_batched_tokens, then one token per "
            "unfinished sequence per llama_decode, greedy. It runs the GGUF as stored (a quantized "
            "file stays quantized), Weir runs that file's weights dequantized to --dtype."
        )
    table = throughput_markdown(runs, machine, command, workload, notes)
    print(table)
    if args.markdown is not None:
        append_markdown(args.markdown, table)
    if args.output_json is not None:
        write_json(
            args.output_json,
            {
                "command": command,
                "machine": machine,
                "model": str(model_dir),
                "dtype": args.dtype,
                "workload": workload,
                "num_requests": len(requests),
                "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                "output_tokens": sum(r.output_len for r in requests),
                "engines": [r.to_dict() for r in runs],
                "ratios_output_tokens_per_s": _ratios(runs),
                "notes": notes,
            },
        )
    return 0
