"""The `weir` command: one subcommand per role or tool.

weir serve                     scheduler + executor(s) on this machine, supervised
weir scheduler / weir executor one role alone (how Kubernetes runs them)
weir generate "prompt"         one request against a running server
weir chat                      an interactive chat against a running server
weir run-batch -i IN -o OUT    a file of OpenAI batch requests, answered by engines of its own
weir prepare-model             fetch/convert a model and print its directory
weir keys DIR                  make the CurveZMQ keys that authenticate clients and executors
weir bench throughput|serve    measurements (see services/bench)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from weir.services import launcher
from weir.services.config_file import (
    ConfigFileError,
    add_config_flag,
    apply_config_file,
    none_required,
)
from weir.services.cpu_cores import (
    THREAD_ENV_VARS,
    executor_threads,
    parse_cores,
    single_thread_env,
)
from weir.services.gateway.chat_output import ChatParsers
from weir.services.gateway.reasoning import REASONING_PARSERS
from weir.services.gateway.tls import Tls
from weir.services.gateway.tool_calls import TOOL_CALL_PARSERS
from weir.services.sigterm import Terminated, raise_terminated
from weir.services.supervised import StatusReporter
from weir.shared.config import (
    DEFAULT_ADDRESS,
    DEFAULT_EXECUTOR_METRICS_PORT,
    DEFAULT_EXECUTOR_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    EXECUTOR,
    LOG_LEVELS,
    SCHEDULER,
    EngineArgs,
    check_connect_address,
    parse_size,
    resolve_max_model_len,
    tcp_address,
)
from weir.shared.config_fields import json_object
from weir.shared.hub_cache import resolve_hub_ids
from weir.shared.pooling import RUNNERS
from weir.shared.protocol.client import Prompt
from weir.shared.sampling import SamplingParams

if TYPE_CHECKING:  # the app's module imports FastAPI: only the commands that serve it pay
    from weir.services.gateway.app import ApiOptions


def _setup_logging(level: str, role: str, replica: int | None = None) -> None:
    if replica is not None:  # one of several engines under `weir serve --data-parallel-size`
        role += f" of replica {replica}"
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s",
    )


def _port(text: str) -> int:
    """A TCP port (0: any free one): argparse's int would let 70000 wrap to 4464."""
    port = int(text) if text.lstrip("-").isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (0-65535; 0 = any free)")
    return port


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return seconds


def _host(text: str) -> str:
    """An address (or name) of this machine to bind: ZeroMQ's bind error named the port
    option for a host that does not resolve or is not here."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            text, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot bind {text!r}: {exc.strerror} (an address or name of this machine, e.g. "
            "127.0.0.1, or 0.0.0.0 for all)"
        ) from None
    return text


# The least --max-request-size: a chat request with its sampling options is a few hundred
# bytes (0 answered every POST with 413).
_MIN_REQUEST_BYTES = 1 << 10


def _request_size(text: str) -> int:
    size = parse_size(text)
    if size < _MIN_REQUEST_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1KiB: no request fits (e.g. 1MiB)")
    return size


def _count(text: str) -> int:
    count = int(text) if text.isdigit() else -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r} (e.g. 100)")
    return count


def _root_path(text: str) -> str:
    path = text.rstrip("/")
    if path and (not path.startswith("/") or any(c in path for c in "?#% ")):
        raise argparse.ArgumentTypeError(f"not a URL path: {text!r} (e.g. /llm)")
    return path


def _keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from weir.shared.keys import FILES_NEEDED, make_keys

    directory = Path(args.dir)
    try:
        make_keys(directory)
    except OSError as exc:
        print(f"weir keys: {exc}", file=sys.stderr)
        return 1
    print(f"CurveZMQ keys written to {directory}. Each process needs only its files:")
    for role, files in FILES_NEEDED.items():
        print(f"  {role + ':':10} {' '.join(files)}")
    print("Point each process at its folder with --keys-dir (or $WEIR_KEYS_DIR).")
    return 0


def _prepare_model(args: argparse.Namespace) -> int:
    from weir.shared.model_store import resolve_model

    try:
        # The tokenizer as serve takes it: a directory with a tokenizer.json (a typo is told
        # here, not by the served engine after a build it would not use), and the model's
        # own path naming no other tokenizer (serve then uses the build with it).
        tokenizer = EngineArgs(model=args.model, tokenizer=args.tokenizer).tokenizer
        print(resolve_model(args.model, tokenizer=tokenizer))
    except (ValueError, OSError, RuntimeError) as exc:  # each says what to do, in one line
        print(f"weir prepare-model: {exc}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ roles


def _scheduler(args: argparse.Namespace) -> int:
    os.environ.update(single_thread_env())  # before any import that may start a thread pool
    from weir.services.engine.server import SchedulerServer, SchedulerServerOptions
    from weir.shared.model_config import read_model_config
    from weir.shared.model_store import resolve_model
    from weir.shared.shard_layout import ShardLayout

    _setup_logging(args.log_level, "scheduler", args.replica)
    status = StatusReporter(args.status_fd)
    try:
        engine_args = EngineArgs.from_cli(args)
        num_executors = launcher.resolve_num_executors(args.num_executors, engine_args)
        model_dir = resolve_model(
            engine_args.model, load_format=engine_args.load_format, tokenizer=engine_args.tokenizer
        )
        model_config = read_model_config(model_dir, engine_args.hf_overrides)
        # Refused here, not by each rank as it loads (a group that cannot form waits forever).
        ShardLayout.of(model_config, 0, engine_args.tensor_parallel_size)
        max_model_len = resolve_max_model_len(engine_args.max_model_len, model_config.context_len)
        executor_address = args.executor_address or tcp_address(args.host, DEFAULT_EXECUTOR_PORT)
        server = SchedulerServer(
            SchedulerServerOptions(
                model_dir=str(model_dir),
                engine_args=engine_args,
                max_model_len=max_model_len,
                host=args.host,
                port=args.port,
                metrics_port=args.metrics_port,
                executor_address=executor_address,
                num_executors=num_executors,
                metrics_host=args.metrics_host,
                replica=args.replica or 0,
            ),
            status,
            args.parent_pid,
        )
    except (ValueError, OSError) as exc:
        status.error(str(exc))
        if args.status_fd is None:  # a supervisor reports it otherwise
            print(f"weir scheduler: {_option_message(args, exc)}", file=sys.stderr)
        return 2
    return asyncio.run(server.run())


def _executor(args: argparse.Namespace) -> int:
    try:
        check_connect_address(args.scheduler)  # before the model loads, for minutes maybe
    except ValueError as exc:
        return _refuse(args, f"--scheduler: {exc}")
    # Before torch is imported: its OpenMP pool starts at this size, whatever the caller's
    # OMP_NUM_THREADS (an invalid --threads is reported when the model loads).
    if args.threads is None or args.threads >= 1:
        args.threads = executor_threads(args.threads)
        os.environ.update({name: str(args.threads) for name in THREAD_ENV_VARS})
    from weir.services.executor.worker import ExecutorOptions, run_executor

    # RANK: the torch.distributed convention (one pod per rank sets it from its index).
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    _setup_logging(args.log_level, f"executor {rank}", args.replica)
    metrics_port = (
        args.metrics_port if args.metrics_port is not None else DEFAULT_EXECUTOR_METRICS_PORT + rank
    )
    engine_args = _engine_args(args)
    if engine_args.attention_backend == "triton" and not _runs_on_cuda(engine_args.device):
        # Else Triton's traceback at the first forward pass (it finds no GPU driver).
        return _refuse(args, "--attention-backend triton needs a CUDA GPU; use native or torch")
    options = ExecutorOptions(
        scheduler=args.scheduler,
        engine_args=engine_args,
        rank=rank,
        metrics_host=args.metrics_host,
        metrics_port=metrics_port,
    )
    return run_executor(options, args.status_fd, args.parent_pid)


def _runs_on_cuda(device: str | None) -> bool:
    """Whether an executor given ``device`` runs on CUDA: cuda named (the model runner says
    why, if it cannot), or nothing named and a GPU there."""
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _refuse(args: argparse.Namespace, message: str) -> int:
    """Status 2 for an option a role cannot start with: ``message`` to its supervisor, which
    reports it, or else on stderr."""
    StatusReporter(args.status_fd).error(message)
    if args.status_fd is None:
        print(f"weir {args.command}: {message}", file=sys.stderr)
    return 2


def _gateway(args: argparse.Namespace) -> int:
    os.environ.update(single_thread_env())
    from weir.services.gateway.app import REQUESTS_LOGGER
    from weir.services.gateway.router import expand_addresses
    from weir.services.gateway.server import GatewayOptions, serve

    tls = _tls(args)
    _setup_logging(args.log_level, "gateway")
    status = StatusReporter(args.status_fd)
    try:
        schedulers = expand_addresses(args.scheduler or [DEFAULT_ADDRESS])
    except (ValueError, OSError) as exc:
        status.error(str(exc))
        print(f"weir gateway: --scheduler: {exc}", file=sys.stderr)
        return 2
    options = GatewayOptions(
        schedulers=schedulers,
        host=args.host,
        port=args.port,
        api_key=_api_key(args),
        timeout=args.timeout,
        keys_dir=args.keys_dir,
        max_request_bytes=args.max_request_size,
        allowed_origins=args.allowed_origins,
        parsers=_chat_parsers(args),
        uvicorn_log_level=args.uvicorn_log_level,
        root_path=args.root_path,
        tls=tls,
        api=_api_options(args),
        docs=not args.disable_fastapi_docs,
        request_id_headers=args.enable_request_id_headers,
        load_tracking=args.enable_server_load_tracking,
        engine_metrics=args.engine_metrics,
    )
    # Prompts are logged only when asked (vLLM's flag), whatever --log-level says.
    logging.getLogger(REQUESTS_LOGGER).setLevel(
        logging.INFO if args.enable_log_requests else logging.WARNING
    )
    import uvloop

    # uvicorn installs uvloop only in a loop it makes itself; this one is ours (uvloop's
    # compiled loop and transports: ~10% of the gateway's CPU per streamed token).
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(options, status, args.parent_pid))
    except KeyboardInterrupt:  # Ctrl-C before uvicorn took the signal over
        return 0


def _engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine options of parsed flags; an invalid one ends the command with status 2
    and a message that names its flag."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and os.path.normpath(args.model) != os.path.normpath(tag):
            print(
                f"weir {args.command}: the model is {tag!r} or --model {args.model!r}, not both",
                file=sys.stderr,
            )
            raise SystemExit(2)
        args.model = tag
    names: Sequence[str] = getattr(args, "served_model_name", None) or ()
    if args.model is None and len(names) > 1 and _is_a_model(names[-1]):
        # argparse gave the model after --served-model-name's names to them.
        print(
            f"weir {args.command}: --served-model-name took {names[-1]!r}, a model: give the "
            f"model first (weir {args.command} MODEL --served-model-name ...) or as --model",
            file=sys.stderr,
        )
        raise SystemExit(2)
    _resolve_hub_ids(args)
    try:
        if getattr(args, "enable_reasoning", False) and args.reasoning_parser is None:
            raise ValueError(
                "enable_reasoning is refused without --reasoning-parser: Weir separates a "
                "model's reasoning in the format --reasoning-parser names"
            )
        if getattr(args, "task", None) is not None:
            if args.runner not in ("auto", args.task):  # both named, and not alike
                raise ValueError(
                    f"task is the runner {args.task}, not --runner {args.runner}: give one"
                )
            args.runner = args.task
        _rope_into_hf_overrides(args)
        return EngineArgs.from_cli(args)
    except ValueError as exc:
        _exit_with_option_error(args, exc)


def _is_a_model(path: str) -> bool:
    """Whether ``path`` is what a model is given as: a directory with a config.json, or a
    .gguf file."""
    return os.path.isfile(os.path.join(path, "config.json")) or (
        path.endswith(".gguf") and os.path.isfile(path)
    )


def _exit_with_option_error(args: argparse.Namespace, exc: ValueError) -> NoReturn:
    print(f"weir {args.command}: {_option_message(args, exc)}", file=sys.stderr)
    raise SystemExit(2)


def _option_message(args: argparse.Namespace, exc: Exception) -> str:
    """``exc``'s message, the option it starts with (a config field) named as its flag."""
    name, _, rest = str(exc).partition(" ")
    flag = "--" + name.replace("_", "-") if name in vars(args) else name
    return f"{flag} {rest}"


def _serve(args: argparse.Namespace) -> int:
    _tls(args)
    _setup_logging(args.log_level, "serve")
    try:
        server = launcher.ServerProcesses(
            _engine_args(args),
            host=args.host,
            port=args.port,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            executor_metrics_port=args.executor_metrics_port,
            http_port=None if args.no_http else args.http_port,
            http_host=args.http_host,
            api_key=_api_key(args),
            allowed_origins=args.allowed_origins,
            parsers=_chat_parsers(args),
            startup_timeout=args.startup_timeout,
            data_parallel_size=args.data_parallel_size,
            gateway_argv=_gateway_argv(args),
        )
    except ValueError as exc:  # options that only tell together, e.g. ranks and cores
        _exit_with_option_error(args, exc)
    signal.signal(signal.SIGTERM, raise_terminated)
    drain = False
    try:
        try:
            info = server.start()
        except launcher.ChildFailedError as exc:
            print(f"weir serve: {exc}", file=sys.stderr)
            return 1
        http = (
            f"  HTTP:     {info['http_address']}{args.root_path}/v1  (OpenAI API)\n"
            if "http_address" in info
            else ""
        )
        print(
            f"Weir is serving {info['model_name']} ({info['num_blocks']} KV blocks)\n{http}", end=""
        )
        for i, replica in enumerate(info.get("replicas", [info])):
            of = f" of replica {i}" if "replicas" in info else ""
            print(
                f"  clients:  {replica['client_address']}{of}\n"
                f"  metrics:  {replica['metrics_address']}  (scheduler{of})"
            )
            for executor in replica["executors"]:
                threads = f", {executor['threads']} threads" if "threads" in executor else ""
                print(
                    f"            {executor['metrics_address']}  (executor {executor['rank']}"
                    f"{threads}{of})"
                )
        print("Press Ctrl-C to stop.", flush=True)
        name, rc = server.wait()
        print(f"weir serve: {name} exited with code {rc}; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except Terminated:
        drain = True  # as Kubernetes stops a pod: finish what is in flight
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            server.shutdown(drain)
        except KeyboardInterrupt:
            # Ctrl-C while draining (which can take minutes): stop now, as a first one does.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            server.shutdown()


def _run_batch(args: argparse.Namespace) -> int:
    from weir.services import batch
    from weir.services.gateway.app import REQUESTS_LOGGER

    _setup_logging(args.log_level, "run-batch")
    logging.getLogger(REQUESTS_LOGGER).setLevel(
        logging.INFO if args.enable_log_requests else logging.WARNING
    )
    try:
        server = launcher.ServerProcesses(
            _engine_args(args),
            port=0,
            metrics_port=0,
            executor_metrics_port=0,
            startup_timeout=args.startup_timeout,
            data_parallel_size=args.data_parallel_size,
            offline=True,
        )
    except ValueError as exc:  # options that only tell together
        _exit_with_option_error(args, exc)
    if batch.same_file(args.input_file, args.output_file):
        print(
            f"weir run-batch: --output-file {args.output_file} is the input file: writing the "
            "results would erase the requests",
            file=sys.stderr,
        )
        return 2
    try:
        source = batch.open_input(args.input_file)
    except (OSError, ValueError) as exc:
        print(f"weir run-batch: --input-file {args.input_file}: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, raise_terminated)
    started = time.monotonic()
    try:
        with source:
            batch.check_output(args.output_file)
            try:
                server.start()
            except launcher.ChildFailedError as exc:
                print(f"weir run-batch: {exc}", file=sys.stderr)
                return 1
            try:
                with batch.open_output(args.output_file) as output:
                    replicas = server.info.get("replicas", [server.info])
                    counts = asyncio.run(
                        batch.answer_batch(
                            [replica["client_address"] for replica in replicas],
                            server.engine_args.keys_dir,
                            _chat_parsers(args),
                            _api_options(args),
                            source,
                            output,
                            max_in_flight=2 * server.engine_args.step_limits[1] * len(replicas),
                        )
                    )
                    stopped = server.exited
                    server.shutdown()  # before an upload, which may take long
            finally:
                server.shutdown()
    except OSError as exc:  # the output cannot be written or uploaded, the input read on
        print(f"weir run-batch: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated):
        print("weir run-batch: stopped before the last line", file=sys.stderr)
        return 130
    print(
        f"weir run-batch: {counts.succeeded + counts.failed} requests, {counts.succeeded} "
        f"succeeded, {counts.failed} failed, in {time.monotonic() - started:.1f} s; results "
        f"in {args.output_file}",
        file=sys.stderr,
    )
    if stopped is not None:  # the lines after it hold its errors: a job must not pass
        name, rc = stopped
        print(f"weir run-batch: the engine stopped: {name} exited with code {rc}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ clients


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling parameters; invalid values end the command with status 2."""
    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop or ()),
            ignore_eos=args.ignore_eos,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            structured_output=_structured_output(args),
        )
    except ValueError as exc:
        print(f"weir {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _structured_output(args: argparse.Namespace) -> dict[str, object] | None:
    """The format asked for with --json-schema (text, or a file), --json, --regex or
    --choice (argparse lets one through)."""
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{"):
            try:
                schema = Path(schema).read_text()
            except OSError as exc:
                raise ValueError(f"--json-schema: {exc}") from None
        return {"json": schema}
    if args.json:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return None


def _generate(args: argparse.Namespace) -> int:
    from weir.shared.client import WeirClient, WeirError

    params = _sampling_params(args)
    prompt: Prompt = args.prompt
    if args.token_ids:
        try:
            prompt = [int(t) for t in args.prompt.replace(",", " ").split()]
        except ValueError:
            print(
                f"weir generate: --token-ids: {args.prompt!r} is not a list of integers",
                file=sys.stderr,
            )
            return 2
    elif args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    try:
        with WeirClient(args.address, timeout=args.timeout, keys_dir=args.keys_dir) as client:
            texts, last = [], None
            for last in client.generate(prompt, params, lora_name=args.lora_name):
                if args.stream:
                    print(last.text, end="", flush=True)
                texts.append(last.text)
            print("" if args.stream else "".join(texts))
            if last is not None and args.verbose:
                print(
                    f"[{last.prompt_tokens} prompt + {last.completion_tokens} completion tokens, "
                    f"finish_reason={last.finish_reason}]",
                    file=sys.stderr,
                )
    except WeirError as exc:
        print(f"weir generate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _chat(args: argparse.Namespace) -> int:
    from weir.shared.client import WeirClient, WeirError

    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    try:
        client = WeirClient(args.address, timeout=args.timeout, keys_dir=args.keys_dir)
    except WeirError as exc:
        print(f"weir chat: {exc}", file=sys.stderr)
        return 1
    with client:
        try:
            info = client.model_info()
        except WeirError as exc:
            print(f"weir chat: {exc}", file=sys.stderr)
            return 1
        print(f"Chatting with {info['model_name']} (empty line or Ctrl-D to quit)")
        failed = False  # the exit status says whether a turn failed (input may be piped)
        while True:
            try:
                user = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return int(failed)
            if not user:
                return int(failed)
            messages.append({"role": "user", "content": user})
            reply = []
            try:
                for out in client.generate(messages, params, lora_name=args.lora_name):
                    print(out.text, end="", flush=True)
                    reply.append(out.text)
            except KeyboardInterrupt:
                pass  # leaving the stream aborts the request
            except WeirError as exc:
                print(flush=True)
                print(f"weir chat: {exc}", file=sys.stderr)
                failed = True
                messages.pop()
                continue
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


def _health(args: argparse.Namespace) -> int:
    """Exit 0 only when the server is ready to take requests (a readiness probe)."""
    from weir.shared.client import WeirClient, WeirError

    try:
        with WeirClient(args.address, timeout=args.timeout, keys_dir=args.keys_dir) as client:
            health = client.health()
    except WeirError as exc:
        print(f"weir health: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(" ".join(f"{key}={value}" for key, value in health.items()))
    return 0 if health.get("status") == "ok" else 1


# ------------------------------------------------------------------ parser


def _add_child_flags(p: argparse.ArgumentParser) -> None:
    # Set by `weir serve` / LLM for the processes they supervise.
    p.add_argument("--status-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    # The cores this process is pinned to (the supervisor's CPU plan), set before any thread.
    p.add_argument("--cpu-affinity", type=parse_cores, default=None, help=argparse.SUPPRESS)
    # Which of `weir serve --data-parallel-size`'s engines it is part of: its log lines say so.
    p.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)


def _add_metrics_host_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--metrics-host",
        type=_host,
        default=None,
        help=f"address {what} bind to (default: --host)",
    )


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $WEIR_API_KEY, else vLLM's $VLLM_API_KEY (a deployment moved from
    vLLM must not serve open)."""
    return args.api_key or os.environ.get("WEIR_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def _add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API (/v1/..., /tokenize, the engine "
        "controls; not /health, /metrics, /version, /ping, /load) (default: $WEIR_API_KEY, "
        "else $VLLM_API_KEY, else none)",
    )


def _add_allowed_origins_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-origins",
        type=lambda text: [origin.strip() for origin in text.split(",") if origin.strip()],
        default=["*"],
        metavar="ORIGINS",
        help="web origins whose pages may call the API (CORS), comma-separated, e.g. "
        "https://app.example.com,http://localhost:3000; '' for none (default: *, any)",
    )


def _chat_parsers(args: argparse.Namespace) -> ChatParsers:
    return ChatParsers(args.tool_call_parser, args.reasoning_parser)


def _add_api_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags of what the API answers."""
    p.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="the role of a chat's message where the request adds the generation prompt (its "
        "default, add_generation_prompt true; else the last message's role) (default: "
        "assistant)",
    )
    _add_switch(
        p,
        "--enable-force-include-usage",
        help="streamed completions and chats end with the usage chunk and carry each choice's "
        "usage so far in every chunk, whatever stream_options say (whole responses always "
        "carry usage)",
    )
    _add_switch(
        p,
        "--enable-prompt-tokens-details",
        help="vLLM's; usage always holds prompt_tokens_details (cached_tokens), so it changes "
        "nothing",
    )


def _api_options(args: argparse.Namespace) -> ApiOptions:
    from weir.services.gateway.app import ApiOptions

    return ApiOptions(args.response_role, args.enable_force_include_usage, args.max_log_len)


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's logging flags, so that its command lines start Weir."""
    _add_switch(
        p,
        "--enable-log-requests",
        help="log each request the gateway sends on (id, prompt, sampling parameters) at INFO",
    )
    p.add_argument(
        "--max-log-len",
        type=_count,
        default=None,
        metavar="N",
        help="with --enable-log-requests, a logged prompt's texts are cut to N characters and "
        "its token ids to N ids (default: 500 characters and 64 ids, elided in the middle)",
    )
    unlogged = "vLLM's; Weir logs {} unless asked, so it changes nothing"
    _add_switch(p, "--disable-log-requests", help=unlogged.format("no request"))
    # vLLM's has no --no- form.
    p.add_argument(
        "--disable-log-stats", action="store_true", help=unlogged.format("no periodic stats")
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="the HTTP server's (uvicorn's) own logging level (default warning)",
    )


def _add_http_server_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for where the API is served: behind a proxy's path, over HTTPS."""
    p.add_argument(
        "--root-path",
        type=_root_path,
        default="",
        help="the path prefix a proxy serves the API under, e.g. /llm: the routes answer "
        "with and without it (FastAPI's root_path)",
    )
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument(
        "--ssl-keyfile", default=None, help="the certificate's private key (PEM), for HTTPS"
    )
    p.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates that client certificates must match"
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED),
        default=ssl.CERT_NONE,
        help="client certificates: 0 not asked, 1 optional, 2 required (default 0)",
    )
    _add_switch(
        p,
        "--disable-fastapi-docs",
        help="serve no /docs, /redoc or /openapi.json (the API's schema and its pages)",
    )
    _add_switch(
        p,
        "--enable-request-id-headers",
        help="answer every request with an X-Request-Id header: the request's own, else a "
        "random one",
    )
    _add_switch(
        p,
        "--disable-uvicorn-access-log",
        help="vLLM's; Weir's HTTP server writes no access log, so it changes nothing",
    )
    _add_switch(
        p,
        "--enable-server-load-tracking",
        help='GET /load answers {"server_load": N}, N the requests of the generation, '
        "embedding, scoring and pooling routes being answered now (a stream until its end), "
        "as vLLM's (without it, N is always 0)",
    )


def _tls(args: argparse.Namespace) -> Tls | None:
    """HTTPS as the ``--ssl-*`` flags ask for it, its files loaded: a wrong one ends the
    command at once (`weir serve` would find it only once the engine has started)."""
    problem = None
    if args.ssl_certfile is None and (
        args.ssl_keyfile is not None
        or args.ssl_ca_certs is not None
        or args.ssl_cert_reqs != ssl.CERT_NONE
    ):
        problem = "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"
    elif args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        problem = "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs client certificates match)"
    tls = None
    if problem is None and args.ssl_certfile is not None:
        tls = Tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        try:
            tls.check()
        except (OSError, ssl.SSLError) as exc:
            problem = f"cannot serve HTTPS with {tls.files()}: {exc}"
    if problem is not None:
        print(f"weir {args.command}: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return tls


def _gateway_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``_add_api_flags``, ``_add_log_flags`` and ``_add_http_server_flags`` that
    the gateway `weir serve` starts takes (those that change nothing are not passed on)."""
    argv = ["--uvicorn-log-level", args.uvicorn_log_level, "--response-role", args.response_role]
    for switch in (
        "enable_force_include_usage",
        "enable_log_requests",
        "disable_fastapi_docs",
        "enable_request_id_headers",
        "enable_server_load_tracking",
    ):
        if getattr(args, switch):
            argv.append("--" + switch.replace("_", "-"))
    if args.max_log_len is not None:
        argv += ["--max-log-len", str(args.max_log_len)]
    if args.root_path:
        argv += ["--root-path", args.root_path]
    for flag in ("certfile", "keyfile", "ca_certs"):
        path = getattr(args, f"ssl_{flag}")
        if path is not None:  # absolute: the gateway may run from another directory
            argv += [f"--ssl-{flag.replace('_', '-')}", os.path.abspath(path)]
    if args.ssl_cert_reqs != ssl.CERT_NONE:
        argv += ["--ssl-cert-reqs", str(args.ssl_cert_reqs)]
    return argv


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags of where a model's files come from and how its engine is laid out, taken
    where they ask for what Weir does and refused, saying why, where they do not."""
    p.add_argument(
        "--download-dir",
        metavar="DIR",
        help="vLLM's: the Hugging Face cache a Hub repo id's snapshot is read from (in place "
        "of $HF_HUB_CACHE; Weir downloads no model); a directory or .gguf file is read where "
        "it is; without a model it is refused: the bundled default model is kept in "
        "$WEIR_CACHE",
    )
    for flag, files in (
        ("--revision", "model"),
        ("--tokenizer-revision", "tokenizer"),
    ):
        p.add_argument(
            flag,
            metavar="REVISION",
            help=f"vLLM's: the revision (branch, tag or commit) of the {files} that a Hub repo "
            "id names, read from its snapshot in the Hugging Face cache (Weir fetches none); "
            "main changes nothing for a directory or .gguf file, another revision is refused",
        )
    p.add_argument(
        "--code-revision",
        metavar="REVISION",
        help="vLLM's; Weir runs no code from a model's files, so it changes nothing",
    )
    p.add_argument(
        "--distributed-executor-backend",
        type=_vllm_value(
            ("mp", "uni"),
            "Weir's executors are processes that `weir serve` starts on this machine (mp); "
            "across machines each runs as `weir executor` (a Kubernetes pod: k8s/)",
        ),
        metavar="mp",
        help="vLLM's; mp (or uni, one GPU) changes nothing: Weir's executors are processes "
        "`weir serve` starts; ray and external_launcher are refused",
    )
    p.add_argument(
        "--cpu-offload-gb",
        type=_only_zero(
            "Weir keeps a model's weights on the device that runs it, none offloaded to CPU memory"
        ),
        metavar="0",
        help="vLLM's; 0 changes nothing; more is refused: Weir keeps a model's weights on the "
        "device that runs it",
    )
    p.add_argument(
        "--kv-transfer-config",
        type=_vllm_value(
            (),
            "Weir has no disaggregated prefill: each engine computes the KV cache of its own "
            "requests and sends none to another",
        ),
        metavar="JSON",
        help="vLLM's; refused: Weir has no disaggregated prefill (KV connectors)",
    )
    p.add_argument(
        "--max-seq-len-to-capture",
        type=_count,
        metavar="N",
        help="vLLM's; Weir's CUDA graphs serve steps at any context length up to "
        "--max-model-len (their block tables are that wide), so it changes nothing "
        "(--enforce-eager runs without graphs, --max-mixed-graph-tokens bounds the mixed "
        "steps that replay them)",
    )
    for flag in ("--compilation-config", "--cuda-graph-sizes"):
        p.add_argument(
            flag,
            type=_vllm_value((), _WEIRS_GRAPHS),
            metavar="VALUE",
            help="vLLM's; refused: " + _WEIRS_GRAPHS,
        )
    p.add_argument(
        "--num-scheduler-steps",
        type=_vllm_value(
            ("1",),
            "Weir schedules every step, as vLLM's V1 engine does (multi-step scheduling was its "
            "V0 engine's); --async-scheduling plans a step while the one before runs",
        ),
        metavar="1",
        help="vLLM's (V0); 1, a schedule every step, changes nothing; more is refused",
    )
    p.add_argument(
        "--scheduler-delay-factor",
        type=_only_zero(
            "Weir schedules a waiting prompt at the first step its tokens and blocks fit, "
            "delaying none"
        ),
        metavar="0",
        help="vLLM's (V0); 0, no delay, changes nothing; more is refused",
    )
    p.add_argument(
        "--use-v2-block-manager",
        action="store_true",
        help="vLLM's (V0, where 0.6 made it change nothing); Weir's KV cache is paged blocks, "
        "so it changes nothing",
    )
    _add_switch(
        p,
        "--disable-custom-all-reduce",
        help="vLLM's; Weir's tensor-parallel ranks all-reduce through torch.distributed (NCCL "
        "on GPU), with no custom kernel to disable, so it changes nothing",
    )
    _add_switch(
        p,
        "--disable-frontend-multiprocessing",
        help="vLLM's; its V1 engine ignores it too: the engine runs in processes of its own, "
        "as Weir's scheduler and executors do, so it changes nothing",
    )
    p.add_argument(
        "--enable-expert-parallel",
        "--no-enable-expert-parallel",
        action=_Refused,
        why="Weir splits every MoE expert across the --tensor-parallel-size ranks (vLLM's "
        "layout without expert parallelism), and its data-parallel replicas share no experts",
        help="vLLM's; refused: Weir splits each MoE expert by tensor parallelism",
    )
    _add_switch(
        p,
        "--enable-sleep-mode",
        help="vLLM's; Weir's sleep mode (POST /sleep, /wake_up, GET /is_sleeping) is always "
        "served, so it changes nothing",
    )


# Why vLLM's torch.compile and CUDA graph settings are refused.
_WEIRS_GRAPHS = (
    "Weir compiles nothing with torch.compile; on CUDA it captures its own graphs, of the "
    "decode steps and of mixed steps up to --max-mixed-graph-tokens (--enforce-eager: none)"
)


def _only_zero(why: str) -> Callable[[str], float]:
    """The type of a vLLM flag whose number 0 asks for what Weir does; any other is refused,
    saying ``why``."""

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value != 0:
            raise argparse.ArgumentTypeError(f"{text!r} is refused: {why}")
        return value

    return check


class _Refused(argparse.Action):
    """A vLLM switch that asks for what Weir does not do: refused, saying ``why``, when given
    (argparse would only call it unrecognized)."""

    def __init__(self, option_strings: list[str], dest: str, why: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.why = why

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            return  # vLLM's --no-FLAG of a bool field: what Weir does
        parser.error(f"{option_string} is refused: {self.why}")


def _resolve_hub_ids(args: argparse.Namespace) -> None:
    """vLLM's ``--download-dir``, ``--revision`` and ``--tokenizer-revision``
    (``hub_cache.resolve_hub_ids``): a model, tokenizer or draft naming a repo id in the
    Hugging Face cache becomes its snapshot."""
    names = ("model", "tokenizer", "speculative_model")
    try:
        resolved = resolve_hub_ids(
            {name: getattr(args, name, None) for name in names},
            getattr(args, "download_dir", None),
            getattr(args, "revision", None),
            getattr(args, "tokenizer_revision", None),
        )
    except ValueError as exc:
        _exit_with_option_error(args, exc)
    for name in names:
        if hasattr(args, name):
            setattr(args, name, resolved[name])


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags whose behaviour Weir always has (at some values: the others are
    refused, saying why)."""
    _add_switch(
        p,
        "--trust-remote-code",
        help="vLLM's; Weir runs no code from a model's files (its own architectures, "
        "safetensors or GGUF weights, tokenizer.json, a sandboxed chat template), so it "
        "changes nothing",
    )
    p.add_argument(
        "--swap-space",
        type=float,
        default=None,
        metavar="GIB",
        help="vLLM's; its V1 engine swaps no KV cache to the CPU and neither does Weir (a "
        "preempted request is recomputed), so it changes nothing",
    )
    p.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=_vllm_value(
            ("1",),
            "Weir splits a model across GPUs by tensor parallelism (--tensor-parallel-size), "
            "not into pipeline stages",
        ),
        metavar="1",
        help="vLLM's; 1, one stage, changes nothing; more is refused: Weir splits a model "
        "across GPUs by --tensor-parallel-size only",
    )
    p.add_argument(
        "--tokenizer-mode",
        type=_vllm_value(
            ("auto", "hf"),
            "Weir reads the model's tokenizer.json (or --tokenizer's) with the tokenizers "
            "library (vLLM's auto), and has no slow or mistral_common tokenizer",
        ),
        metavar="auto",
        help="vLLM's; auto (or hf), the model's tokenizer.json (or --tokenizer's), changes "
        "nothing; slow and mistral are refused",
    )
    _add_switch(
        p,
        "--language-model-only",
        help="vLLM's; Weir serves a vision-language checkpoint's language model alone anyway "
        "(but Idefics3's and SmolVLM's, which it serves whole), so it changes nothing",
    )
    p.add_argument(
        "--task",
        type=_task_runner,
        metavar="TASK",
        help="vLLM's name before --runner: generate is --runner generate; embed (embedding), "
        "classify and score are --runner pooling; auto is auto; reward and transcription are "
        "refused",
    )
    p.add_argument(
        "--rope-scaling",
        metavar="JSON",
        help="vLLM's; config.json's rope_scaling replaced, as --hf-overrides "
        "'{\"rope_scaling\": JSON}' does (over --hf-overrides' own)",
    )
    p.add_argument(
        "--guided-decoding-backend",
        type=_vllm_value(
            ("xgrammar",),
            "Weir's structured outputs are xgrammar's, with no outlines, lm-format-enforcer or "
            "guidance backend (nor vLLM's auto fallback to guidance)",
        ),
        metavar="xgrammar",
        help="vLLM's; xgrammar, the backend of Weir's structured outputs, changes nothing; "
        "others are refused",
    )
    p.add_argument(
        "--chat-template-content-format",
        type=_vllm_value(
            ("string", "auto"),
            "Weir gives the chat template each message's content as one string, its text parts "
            "joined by newlines (vLLM's string), but a model's that reads images, whose "
            "template reads a list of parts (vLLM's openai)",
        ),
        metavar="string",
        help="vLLM's; string (and auto, the default: Weir's is string, or openai for a model "
        "that reads images) changes nothing: Weir gives the chat template the text parts "
        "joined by newlines; openai is refused",
    )
    p.add_argument(
        "--logits-processor-pattern",
        type=_vllm_value(
            (),
            "Weir loads no logits processor a request names (the pattern would let requests "
            "name them)",
        ),
        metavar="REGEX",
        help="vLLM's; refused: Weir loads no logits processor a request names",
    )


# vLLM's --task values (before --runner): the runner each is. Each runner is its own too:
# a --config file's task comes back through the type as the runner it was made.
_TASK_RUNNERS = {
    **{runner: runner for runner in RUNNERS},
    **dict.fromkeys(("embed", "embedding", "classify", "score"), "pooling"),
}


def _task_runner(text: str) -> str:
    if text not in _TASK_RUNNERS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is refused: Weir's runners generate text (generate) or pool a prompt "
            "into one embedding or classification (embed, classify, score)"
        )
    return _TASK_RUNNERS[text]


def _rope_into_hf_overrides(args: argparse.Namespace) -> None:
    """vLLM's --rope-scaling, which its engine lays over config.json as hf_overrides, over
    --hf-overrides' rope_scaling (as there)."""
    if getattr(args, "rope_scaling", None) is not None:
        overrides = json_object("hf_overrides", args.hf_overrides or "{}")
        rope = json_object("rope_scaling", args.rope_scaling)
        if rope and "rope_type" not in rope and "type" not in rope:
            # Without its type the rotation would stay the model's default, the factor unread.
            raise ValueError(
                f"rope_scaling {args.rope_scaling} names no rope_type (linear, llama3, yarn, "
                "longrope): give it, as config.json's rope_scaling does"
            )
        args.hf_overrides = json.dumps({**overrides, "rope_scaling": rope})


def _add_switch(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An off-by-default switch that takes vLLM's --no- form too (its bool fields are
    argparse's BooleanOptionalAction)."""
    p.add_argument(flag, action=argparse.BooleanOptionalAction, default=False, help=help)


def _vllm_value(taken: tuple[str, ...], why: str) -> Callable[[str], str]:
    """The type of a vLLM flag whose values ``taken`` ask for what Weir does; any other is
    refused, saying ``why``, rather than left without effect."""

    def check(text: str) -> str:
        if text not in taken:
            raise argparse.ArgumentTypeError(f"{text!r} is refused: {why}")
        return text

    return check


def _add_parser_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model's tool-call format, which the API reads calls out of under tool_choice "
        "'auto' (hermes: <tool_call>{...}</tool_call>, Qwen2.5/Qwen3; llama3_json: "
        '{"name": ..., "parameters": ...}, Llama 3.1-3.3; pythonic: [f(a=1), g(b="x")], '
        "Llama 3.2 and 4; qwen3_coder: <tool_call><function=NAME><parameter=KEY>..., "
        "Qwen3-Coder; mistral: [TOOL_CALLS]NAME[ARGS]{...} or [TOOL_CALLS][{...}], Mistral "
        "Small 3.x, Devstral, Magistral; openai: gpt-oss' harmony messages to "
        "functions.NAME); without it "
        "'auto' is refused, and 'required' or a named function still work",
    )
    _add_switch(
        p,
        "--enable-auto-tool-choice",
        help="accepted as vLLM's command lines give it: tool_choice 'auto' is served whenever "
        "--tool-call-parser is given",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="the model's reasoning format, which the chat API returns as the message's "
        "reasoning (and reasoning_content) apart from its content: <think>...</think> "
        "(deepseek_r1: DeepSeek-R1 and its distills, QwQ; qwen3: Qwen3, which also honours "
        "chat_template_kwargs enable_thinking false); mistral: [THINK]...[/THINK], "
        "Magistral; openai_gptoss: gpt-oss' harmony analysis channel",
    )
    p.add_argument(
        "--enable-reasoning",
        action="store_true",
        help="vLLM's (0.7-0.9, where it needed --reasoning-parser); Weir separates the "
        "reasoning whenever --reasoning-parser is given, so with it this changes nothing; "
        "alone it is refused",
    )


def _add_data_parallel_flag(p: argparse.ArgumentParser, behind: str, ports: str = "") -> None:
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines, each a scheduler and its executors (with --tensor-parallel-size N, N "
        f"GPUs each), behind {behind}, whose router spreads the requests{ports} (default: 1)",
    )


def _add_keys_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys-dir",
        default=None,
        help="CurveZMQ keys (client.key_secret, server.key) of a server that requires them "
        "(default: $WEIR_KEYS_DIR, else none)",
    )


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument(
        "--address",
        default=os.environ.get("WEIR_ADDRESS", DEFAULT_ADDRESS),
        help=f"scheduler address (default {DEFAULT_ADDRESS} or $WEIR_ADDRESS)",
    )
    _add_keys_dir_flag(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--lora-name", default=None, help="the LoRA adapter (of the server's --lora-modules)"
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default: 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default)")
    formats = p.add_mutually_exclusive_group()
    formats.add_argument(
        "--json-schema", default=None, help="the output follows this JSON schema (text or a file)"
    )
    formats.add_argument("--json", action="store_true", help="the output is a JSON object")
    formats.add_argument("--regex", default=None, help="the output matches this expression")
    formats.add_argument(
        "--choice", action="append", default=None, help="the output is one of these (repeatable)"
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds before an unresponsive server is an error (default: 30)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="Weir LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="fetch and convert a model; print its directory")
    p.add_argument(
        "--model", default=None, help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the tokenizer the model will be served with (serve's --tokenizer): a .gguf file "
        "is then converted without its own",
    )
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("keys", help="make CurveZMQ keys: only processes holding them can connect")
    p.add_argument("dir", help="directory to write the keys into (created 0700)")
    p.set_defaults(func=_keys)

    p = sub.add_parser("serve", help="run a scheduler and its executor on this machine")
    p.add_argument(
        "--host",
        type=_host,
        default="127.0.0.1",
        help="address the engine's sockets (and, unless --http-host, the HTTP API) bind to "
        "(default: 127.0.0.1)",
    )
    p.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"client port (0 = any free; default: {DEFAULT_PORT})",
    )
    _add_metrics_host_flag(p, "every process's /metrics and /health")
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=DEFAULT_METRICS_PORT,
        help=f"scheduler Prometheus port (0 = any free; default: {DEFAULT_METRICS_PORT})",
    )
    p.add_argument(
        "--executor-metrics-port",
        type=_port,
        default=DEFAULT_EXECUTOR_METRICS_PORT,
        help="executor rank 0's Prometheus port, rank r uses +r (0 = any free; default: "
        f"{DEFAULT_EXECUTOR_METRICS_PORT})",
    )
    p.add_argument(
        "--http-port",
        type=_port,
        default=DEFAULT_HTTP_PORT,
        help=f"OpenAI-compatible HTTP API port (0 = any free; default: {DEFAULT_HTTP_PORT})",
    )
    p.add_argument(
        "--http-host",
        type=_host,
        default=None,
        help="address the HTTP API binds to (default: --host); e.g. 0.0.0.0 for the API alone",
    )
    p.add_argument("--no-http", action="store_true", help="do not start the HTTP gateway")
    _add_data_parallel_flag(
        p, "the one HTTP gateway", "; replica i takes --port + 100 i and --metrics-port + 100 i"
    )
    _add_api_key_flag(p)
    _add_allowed_origins_flag(p)
    _add_parser_flags(p)
    _add_api_flags(p)
    _add_log_flags(p)
    _add_http_server_flags(p)
    p.add_argument(
        "--startup-timeout",
        type=_positive_seconds,
        default=600.0,
        help="seconds every process gets to start (load, compile, capture) before "
        "`weir serve` gives up (default 600)",
    )
    EngineArgs.add_cli_args(p, "serve")
    _add_model_flags(p)
    _add_deployment_flags(p)
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (or --model)",
    )
    add_config_flag(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests with engines started for it",
        description="Answer a file of OpenAI batch requests (vLLM's run-batch): each line "
        '{"custom_id", "method": "POST", "url", "body"}, the url one of the API\'s generation, '
        "embedding, scoring and pooling endpoints (/v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/embeddings, /v1/score, /v1/rerank, /classify, /pooling); "
        "each output line, in the input's order, "
        '{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.',
    )
    p.add_argument(
        "-i", "--input-file", required=True, help="the requests: a JSONL file or an http(s) URL"
    )
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="the results: a JSONL file, or an http(s) URL they are PUT to once all are done",
    )
    p.add_argument(
        "--startup-timeout",
        type=_positive_seconds,
        default=600.0,
        help="seconds the engine gets to start before `weir run-batch` gives up (default 600)",
    )
    _add_data_parallel_flag(p, "the batch's in-process API")
    _add_parser_flags(p)
    _add_api_flags(p)
    _add_log_flags(p)
    EngineArgs.add_cli_args(p, "serve")
    _add_model_flags(p)
    _add_deployment_flags(p)
    add_config_flag(p)
    p.set_defaults(func=_run_batch)

    p = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway alone")
    p.add_argument(
        "--scheduler",
        action="append",
        help=f"an engine replica's client address, repeatable; a host name that resolves to "
        f"several addresses counts as one replica each (default {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--host", type=_host, default="127.0.0.1", help="address the HTTP server binds to"
    )
    p.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_HTTP_PORT,
        help=f"HTTP port (0 = any free; default: {DEFAULT_HTTP_PORT})",
    )
    _add_api_key_flag(p)
    _add_allowed_origins_flag(p)
    _add_parser_flags(p)
    _add_api_flags(p)
    _add_log_flags(p)
    _add_http_server_flags(p)
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds a replica may stay silent before its requests fail (default: 30)",
    )
    p.add_argument(
        "--max-request-size",
        type=_request_size,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest HTTP request body, e.g. 1MiB, at least 1KiB; larger ones get 413 "
        "(default 64MiB)",
    )
    p.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="an engine replica's scheduler /metrics URL, repeatable: its series join the "
        "gateway's own at /metrics, labelled engine=<index> (`weir serve` gives them)",
    )
    _add_keys_dir_flag(p)
    p.add_argument(
        "--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS, help="logging level"
    )
    _add_child_flags(p)
    add_config_flag(p)
    p.set_defaults(func=_gateway)

    p = sub.add_parser("scheduler", help="run the scheduler process alone")
    p.add_argument("--host", type=_host, default="127.0.0.1", help="address the sockets bind to")
    p.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"client port (0 = any free; default: {DEFAULT_PORT})",
    )
    _add_metrics_host_flag(p, "/metrics and /health")
    p.add_argument("--metrics-port", type=_port, default=DEFAULT_METRICS_PORT)
    p.add_argument(
        "--executor-address",
        default=None,
        help=f"where executors connect (default tcp://HOST:{DEFAULT_EXECUTOR_PORT})",
    )
    p.add_argument(
        "--num-executors",
        type=int,
        default=None,
        help="executor ranks to wait for, at least 1 (default: --tensor-parallel-size; more than 1 "
        "without it: replicas that each run the whole model)",
    )
    EngineArgs.add_cli_args(p, SCHEDULER)
    _add_child_flags(p)
    add_config_flag(p)
    p.set_defaults(func=_scheduler)

    p = sub.add_parser(
        "executor",
        help="run one executor process alone",
        description="Run one executor process alone. It exits when the scheduler it joined "
        "restarts or gives it up as lost (its state would be stale): run it under a "
        "supervisor that starts it again (Kubernetes, systemd; `weir serve` does so itself).",
    )
    p.add_argument("--scheduler", required=True, help="the scheduler's executor address")
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="this executor's rank (default: $RANK, else 0); with --tensor-parallel-size N "
        "the ranks 0..N-1 meet at $MASTER_ADDR:$MASTER_PORT (default 127.0.0.1:29500)",
    )
    p.add_argument(
        "--metrics-host",
        type=_host,
        default="127.0.0.1",
        help="address /metrics and /health bind to (default 127.0.0.1)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help=f"Prometheus port (default {DEFAULT_EXECUTOR_METRICS_PORT} + rank; 0 = any free)",
    )
    EngineArgs.add_cli_args(p, EXECUTOR)
    _add_child_flags(p)
    add_config_flag(p)
    p.set_defaults(func=_executor)

    p = sub.add_parser("generate", help="send one prompt to a running server")
    p.add_argument("prompt")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user chat message (the model's chat template)",
    )
    kind.add_argument("--token-ids", action="store_true", help="the prompt is token ids: '1 2 3'")
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print token count and finish reason"
    )
    _add_sampling_flags(p, max_tokens=64)
    p.set_defaults(func=_generate)

    sub.add_parser("bench", help="measure throughput and latency (weir bench -h)")

    p = sub.add_parser("health", help="exit 0 when a server is ready (readiness probe)")
    p.add_argument("--address", default=os.environ.get("WEIR_ADDRESS", DEFAULT_ADDRESS))
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=5.0,
        help="seconds to wait for the answer (default: 5)",
    )
    _add_keys_dir_flag(p)
    p.set_defaults(func=_health)

    p = sub.add_parser("chat", help="chat with a running server")
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_flags(p, max_tokens=256)
    p.set_defaults(func=_chat)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv``'s flags, with those of a ``--config`` file under them; exits with status 2
    on a bad one, as argparse does."""
    argv = [_dashed(arg) for arg in argv]
    parser = build_parser()
    command = _subcommand_parser(parser, argv[0]) if argv else None
    if command is None or "--config" not in command._option_string_actions:
        return parser.parse_args(argv)
    with none_required(command):  # they may come from the file
        first = command.parse_args(argv[1:])
    if first.config is None:
        return parser.parse_args(argv)
    # A model given on the command line wins over the file's, as vLLM's.
    skip = {"model"} if getattr(first, "model_tag", None) is not None else set()
    try:
        if len(first.config) > 1:
            raise ConfigFileError(f"--config is given {len(first.config)} times; give one file")
        apply_config_file(command, first.config[0], skip)
    except ConfigFileError as exc:
        print(f"weir {argv[0]}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return parser.parse_args(argv)


def _dashed(arg: str) -> str:
    """A flag spelt with underscores (``--max_model_len=2048``) as its dashed name, as vLLM's
    parser takes it; its value is left as given."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _subcommand_parser(
    parser: argparse.ArgumentParser, name: str
) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The harness imports numpy and friends; only `weir bench` pays for that.
        from weir.services.bench import run_cli

        return run_cli(argv[1:])
    args = parse_args(argv)
    if getattr(args, "cpu_affinity", None):
        os.sched_setaffinity(0, args.cpu_affinity)
    command: Callable[[argparse.Namespace], int] = args.func
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
