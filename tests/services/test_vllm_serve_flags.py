"""`vllm serve` flags on `weir serve`: one server started from such a command line, as a user
runs it, checked with the official `openai` client, httpx and the SDK. What the flags change
is compared with test_gateway.py's server, started without them."""

import io
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from weir.services import batch
from weir.services.cli import _api_options, _engine_args, _gateway_argv, build_parser, parse_args
from weir.services.gateway.chat_output import NO_PARSERS
from weir.shared.client import InvalidRequestError, WeirClient
from weir.shared.config import EngineArgs
from weir.shared.model_config import read_model_config
from weir.shared.sampling import SamplingParams

MODEL = "tiny"
MAX_LOGPROBS = 25  # not vLLM's default 20, so that a limit left at 20 shows
MAX_LOG_LEN = 12
ROLE = "narrator"
ENGINE_FLAGS = ["--scheduling-policy", "priority", "--max-logprobs", str(MAX_LOGPROBS)]
API_FLAGS = [
    "--enable-force-include-usage",
    "--response-role", ROLE,
    "--enable-log-requests",
    "--max-log-len", str(MAX_LOG_LEN),
]  # fmt: skip
HTTP_FLAGS = [
    "--disable-fastapi-docs",
    "--enable-request-id-headers",
    "--enable-server-load-tracking",
]
# vLLM's flags whose behaviour Weir always has (run-batch takes the first three).
UNCHANGED = [
    "--trust-remote-code",
    "--swap-space=4",
    "--enable-prompt-tokens-details",
    "--disable-uvicorn-access-log",
]
FLAGS = ENGINE_FLAGS + API_FLAGS + HTTP_FLAGS + UNCHANGED
# vLLM's spellings the server is started with too: a flag with underscores, -pp 1,
# --tokenizer-mode auto, --dtype float (float32), and --tokenizer naming the model; and
# vLLM's deployment flags at the values that ask for what Weir does.
SPELLINGS = ["--max_num_seqs=32", "-pp", "1", "--tokenizer-mode", "auto", "--dtype", "float"]
DEPLOYMENT = [
    "--download-dir", "/nonexistent", "--revision", "main", "--code-revision", "abc123",
    "--distributed-executor-backend", "mp", "--cpu-offload-gb", "0",
    "--max-seq-len-to-capture", "8192", "--load-format", "safetensors",
]  # fmt: skip


class _Server:
    def __init__(self, tiny_model_dir) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weir.services.cli", "serve", str(tiny_model_dir),
             "--served-model-name", MODEL, "--device", "cpu", "--max-model-len", "256",
             "--block-size", "16", "--max-num-batched-tokens", "64", "--kv-cache-memory",
             "4MiB", "--port", "0", "--metrics-port", "0", "--executor-metrics-port", "0",
             "--http-port", "0", *FLAGS, *SPELLINGS, *DEPLOYMENT, "--tokenizer",
             str(tiny_model_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.log: list[str] = []
        # Read on, so that the processes never block on a full pipe.
        threading.Thread(target=self.log.extend, args=(self.proc.stderr,), daemon=True).start()
        printed = ""
        for line in self.proc.stdout:
            printed += line
            if line.startswith("Press Ctrl-C"):
                break
        else:
            raise AssertionError(f"weir serve did not start: {printed}{''.join(self.log)}")
        self.http = re.search(r"HTTP:\s+(\S+)/v1", printed).group(1)
        self.clients = re.search(r"clients:\s+(\S+)", printed).group(1)

    def logged(self, words: str) -> str:
        """The first line of the log holding ``words``, once it is written."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = [line for line in list(self.log) if words in line]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"{words!r} never logged")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(timeout=60) == 0
        finally:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = _Server(tiny_model_dir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)


def test_scheduling_policy_is_vllms_name_for_policy(client):
    for flag in ("--scheduling-policy", "--policy"):
        assert build_parser().parse_args(["serve", flag, "priority"]).policy == "priority"
    # A FCFS server refuses a priority.
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, extra_body={"priority": -1}
    )
    assert out.usage.completion_tokens == 2


def test_max_logprobs_bounds_what_a_request_may_ask_for(server, client):
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, logprobs=MAX_LOGPROBS
    )
    assert len(out.choices[0].logprobs.top_logprobs[0]) >= MAX_LOGPROBS
    limit = f"greater than max allowed: {MAX_LOGPROBS}"
    refused = [
        dict(prompt="Hello", logprobs=MAX_LOGPROBS + 1),
        dict(prompt="Hello", logprobs=MAX_LOGPROBS + 1, stream=True),
        dict(prompt="Hello", extra_body={"prompt_logprobs": MAX_LOGPROBS + 1}),
    ]
    for fields in refused:
        with pytest.raises(openai.BadRequestError, match=limit):
            client.completions.create(model=MODEL, max_tokens=2, **fields)
    with pytest.raises(openai.BadRequestError, match=limit):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            logprobs=True,
            top_logprobs=MAX_LOGPROBS + 1,
        )
    with WeirClient(server.clients) as sdk:  # the engine's limit, not the gateway's
        outs = list(sdk.generate("Hello", SamplingParams(max_tokens=1, logprobs=22)))
        assert len(outs[-1].logprobs["tokens"][0]) == 23  # the sampled token and 22 more
        with pytest.raises(InvalidRequestError, match=limit):
            list(sdk.generate("Hello", SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS + 1)))


def test_fastapi_docs_are_not_served(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.http + path).status_code == 404, path
    assert httpx.get(server.http + "/health").status_code == 200


def test_every_response_carries_the_request_id(server):
    given = {"X-Request-Id": "trace-7"}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    whole = httpx.post(server.http + "/v1/completions", json=body, headers=given)
    assert whole.status_code == 200 and whole.headers["x-request-id"] == "trace-7"
    with httpx.stream(
        "POST", server.http + "/v1/completions", json={**body, "stream": True}, headers=given
    ) as streamed:
        assert streamed.headers["x-request-id"] == "trace-7"
    health = httpx.get(server.http + "/health")
    assert re.fullmatch("[0-9a-f]{32}", health.headers["x-request-id"])
    assert (
        httpx.get(server.http + "/nowhere").headers["x-request-id"]
        != health.headers["x-request-id"]
    )


def _load(server) -> int:
    reply = httpx.get(server.http + "/load", timeout=30)
    assert reply.status_code == 200
    return reply.json()["server_load"]


def _load_becomes(server, expected: int) -> None:
    """Until /load says ``expected``: a response's last byte reaches the client just before
    its handler returns."""
    deadline = time.monotonic() + 30
    while _load(server) != expected:
        assert time.monotonic() < deadline, f"/load never said {expected}"
        time.sleep(0.02)


def test_load_counts_the_requests_in_flight_a_stream_until_its_end(server):
    assert _load(server) == 0
    http = server.http
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
    streamed = {**body, "stream": True}
    with httpx.Client(base_url=http, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=streamed) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data:")
            with client.stream("POST", "/v1/completions", json=streamed) as left:
                assert next(left.iter_lines()).startswith("data:")
                # Held with their requests kept (200 tokens take the engine a second or
                # so): both streams have begun and not ended.
                paused = client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            try:
                assert paused.status_code == 200
                # The client that left is no longer counted, while the engine holds still.
                _load_becomes(server, 1)
                # A whole response waits for the paused engine too: counted while it does.
                whole = threading.Thread(
                    target=httpx.post,
                    args=(http + "/v1/completions",),
                    kwargs={"json": body, "timeout": 60},
                )
                whole.start()
                _load_becomes(server, 2)
                # Neither /load itself nor the engine's controls nor /health count.
                assert client.get("/health").status_code == 200 and _load(server) == 2
            finally:
                client.post("/resume")
            assert [line for line in events if line][-1] == "data: [DONE]"
        whole.join(timeout=60)
    _load_becomes(server, 0)


def test_streams_carry_usage_without_asking_and_the_chat_role_is_the_servers(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices
    # vLLM's forced usage is continuous too: each chunk's choice's so far.
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4
    messages = [{"role": "user", "content": "Hi"}]
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": False},
        )
    )
    opening = streamed[0]
    assert opening.choices[0].delta.role == ROLE and opening.usage.completion_tokens == 0
    assert streamed[-1].usage.completion_tokens == 2
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert whole.choices[0].message.role == ROLE
    # Without the generation prompt, the output goes on with the last message: its role.
    continued = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"add_generation_prompt": False}
    )
    assert continued.choices[0].message.role == "user"


def test_logged_prompts_are_cut_to_max_log_len(server, client):
    text = "abcdefghijklmnopqrstuvwxyz"
    client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    client.completions.create(model=MODEL, prompt=list(range(100, 140)), max_tokens=1)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1
    )
    assert f"prompt {text[:MAX_LOG_LEN]!r}," in server.logged(f"prompt {text[:MAX_LOG_LEN]!r}")
    ids = list(range(100, 100 + MAX_LOG_LEN))
    assert f"prompt {ids}," in server.logged(f"prompt {ids}")
    chat = [{"role": "user", "content": text[:MAX_LOG_LEN]}]
    assert f"prompt {chat}," in server.logged(f"prompt {chat}")
    assert text[: MAX_LOG_LEN + 1] not in "".join(server.log)


def test_the_flags_are_listed_and_reach_the_gateway_and_run_batch(capsys):
    """`weir serve` passes the gateway's flags on (the server above took them so), and the
    no-op flags are there to be taken."""
    parser = build_parser()
    batch_flags = ENGINE_FLAGS + API_FLAGS + UNCHANGED[:3]
    for command, flags in (
        ("serve", FLAGS + DEPLOYMENT),
        ("run-batch", batch_flags + DEPLOYMENT),
        ("gateway", API_FLAGS + HTTP_FLAGS + UNCHANGED[2:]),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        listed = capsys.readouterr().out
        for flag in flags:
            assert not flag.startswith("--") or flag.split("=")[0] in listed, (command, flag)
    serve = parser.parse_args(["serve", *FLAGS])
    gateway = parser.parse_args(["gateway", *_gateway_argv(serve)])
    assert _api_options(gateway) == _api_options(serve)
    assert gateway.disable_fastapi_docs and gateway.enable_request_id_headers
    assert gateway.enable_server_load_tracking
    run_batch = parser.parse_args(["run-batch", "-i", "x", "-o", "y", *batch_flags])
    assert _api_options(run_batch) == _api_options(serve)
    assert run_batch.policy == "priority" and run_batch.max_logprobs == MAX_LOGPROBS


async def test_run_batch_answers_with_the_servers_role_and_logprobs_limit(server):
    lines = [
        {"body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}},
        {"body": {"prompt": "Hi", "max_tokens": 1, "logprobs": MAX_LOGPROBS + 1}},
    ]
    urls = ["/v1/chat/completions", "/v1/completions"]
    source = io.BytesIO(
        "".join(
            json.dumps({"custom_id": str(i), "method": "POST", "url": url, **line}) + "\n"
            for i, (url, line) in enumerate(zip(urls, lines))
        ).encode()
    )
    output = io.StringIO()
    build = build_parser().parse_args(["run-batch", "-i", "x", "-o", "y", "--response-role", ROLE])
    await batch.answer_batch(
        [server.clients], None, NO_PARSERS, _api_options(build), source, output, 4
    )
    chat, refused = map(json.loads, output.getvalue().splitlines())
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == ROLE
    assert refused["response"]["status_code"] == 400
    assert f"max allowed: {MAX_LOGPROBS}" in json.dumps(refused["response"]["body"])


# Command lines of vLLM deployments (scripts, Dockerfiles, Kubernetes manifests, vLLM's
# docs), the model made the test's: the options each gives Weir.
VLLM_COMMAND_LINES = [
    (
        "--model M --max-model-len 8192 --gpu-memory-utilization 0.85 --max-num-seqs 64 "
        "--tensor-parallel-size 1 --port 8000",
        {"max_model_len": 8192, "gpu_memory_utilization": 0.85, "max_num_seqs": 64},
    ),
    (  # vLLM's Kubernetes guide
        "M --trust-remote-code --enable-chunked-prefill --max_num_batched_tokens 1024",
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 1024},
    ),
    (  # docker run vllm/vllm-openai ...
        "--model M --max_model_len 1024 --api_key EMPTY --gpu_memory_utilization 0.7",
        {"max_model_len": 1024, "api_key": "EMPTY", "gpu_memory_utilization": 0.7},
    ),
    (
        "M --host 127.0.0.1 --port 8000 --gpu-memory-utilization 0.9 --tensor-parallel-size 1 "
        "--pipeline-parallel-size 1 --max-model-len 2084 --max-num-seqs 50 --dtype=bfloat16 "
        "--served-model-name m",
        {"pipeline_parallel_size": "1", "dtype": "bfloat16", "served_model_name": ["m"]},
    ),
    (
        "--model M --max_model_len=15000 --port=9003 --tensor_parallel_size=1 "
        "--gpu_memory_utilization=0.95",
        {"max_model_len": 15000, "tensor_parallel_size": 1, "port": 9003},
    ),
    (
        "M --max-model-len 16384 --dtype half --gpu-memory-utilization 0.50 --port 8002",
        {"dtype": "half", "max_model_len": 16384},
    ),
    (
        "M --tokenizer M --seed 42 --max-model-len 2048 --tokenizer-mode auto",
        {"tokenizer": "M", "seed": 42, "tokenizer_mode": "auto"},
    ),
    (
        "M --enforce_eager --trust_remote_code --enable-auto-tool-choice "
        "--tool-call-parser hermes --kv-cache-dtype fp8 --disable-log-requests",
        {"enforce_eager": True, "tool_call_parser": "hermes", "kv_cache_dtype": "fp8"},
    ),
    (  # Gemma 4 with its parsers, as vLLM serves it
        "M --max-model-len 32768 --enable-auto-tool-choice --tool-call-parser gemma4 "
        "--reasoning-parser gemma4",
        {"tool_call_parser": "gemma4", "reasoning_parser": "gemma4"},
    ),
    (
        "M --download-dir /data/hf --revision main --tokenizer_revision main "
        "--distributed-executor-backend=mp --cpu-offload-gb 0 --max_seq_len_to_capture 4096",
        {"download_dir": "/data/hf", "revision": "main", "cpu_offload_gb": 0.0},
    ),
    (
        "M --load-format safetensors --distributed_executor_backend uni --code-revision v2 "
        "--enable-server-load-tracking",
        {"load_format": "safetensors", "enable_server_load_tracking": True},
    ),
    (
        "M --enable-reasoning --reasoning-parser deepseek_r1 --task generate "
        "--num-scheduler-steps 1 --scheduler-delay-factor 0.0 --use-v2-block-manager "
        "--disable-custom-all-reduce --disable-frontend-multiprocessing --enable-sleep-mode "
        "--chat-template-content-format auto",
        {"reasoning_parser": "deepseek_r1", "task": "generate", "num_scheduler_steps": "1"},
    ),
    (
        "M --task embed --guided-decoding-backend xgrammar --chat-template-content-format "
        "string --language-model-only",
        {"task": "pooling", "guided_decoding_backend": "xgrammar"},
    ),
    (  # llm-d's precise prefix-cache routing: the engine connects to its indexer's socket
        'M --kv-events-config {"enable_kv_cache_events":'
        'true,"publisher":"zmq","endpoint":"tcp://epp.llm-d:5557","topic":"kv@10.0.0.7@m"}',
        {
            "kv_events_config": '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":'
            '"tcp://epp.llm-d:5557","topic":"kv@10.0.0.7@m"}'
        },
    ),
    (  # the name of a quantized checkpoint's method (its kernels'), as vLLM's docs write it
        "M --quantization awq_marlin",
        {"quantization": "awq_marlin"},
    ),
    (  # vLLM's bool fields take --no-FLAG too (argparse's BooleanOptionalAction)
        "M --no-enable-server-load-tracking --no-enable-expert-parallel --no-enable-sleep-mode "
        "--no-disable-custom-all-reduce --no-disable-frontend-multiprocessing "
        "--no-language-model-only",
        {"enable_server_load_tracking": False, "enable_sleep_mode": False},
    ),
    (
        "M --no-enable-log-requests --no-disable-log-requests --no-enable-request-id-headers "
        "--no-enable-force-include-usage --no-enable-prompt-tokens-details "
        "--no-disable-fastapi-docs --no-disable-uvicorn-access-log --no-trust-remote-code "
        "--no-enable-auto-tool-choice",
        {"enable_log_requests": False, "enable_request_id_headers": False},
    ),
]


@pytest.mark.parametrize(("line", "options"), VLLM_COMMAND_LINES)
def test_vllm_command_lines_parse_into_weir_options(tiny_model_dir, line, options):
    model = str(tiny_model_dir)
    args = parse_args(["serve", *(model if word == "M" else word for word in line.split())])
    if "tokenizer" in options:
        options = {**options, "tokenizer": model}
    assert {name: getattr(args, name) for name in options} == options
    engine_args = _engine_args(args)
    assert engine_args.model == model
    assert engine_args.load_format == "auto"  # vLLM's safetensors too: the weights Weir reads
    # vLLM's half (and float) are float16 (float32), on the command line and in LLM(...).
    assert engine_args.dtype in (None, "bfloat16", "float16")
    assert EngineArgs(dtype="half").dtype == "float16" and EngineArgs(dtype="float").dtype == (
        "float32"
    )


def test_kv_events_endpoints_of_data_parallel_replicas_are_vllms():
    """vLLM's rule for replica i: the port plus i, an ipc name with _dp<i>; a wildcard port
    binds a free one for each."""
    config = EngineArgs(
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "ipc:///tmp/replay",
        }
    ).kv_events
    assert config.publishes and config.for_replica(0) == config
    second = config.for_replica(2)
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5559", "ipc:///tmp/replay_dp2")
    assert EngineArgs(kv_events_config='{"endpoint": "tcp://*:*"}').kv_events.for_replica(
        1
    ).endpoint == ("tcp://*:*")
    assert not EngineArgs().kv_events.publishes  # vLLM's defaults: off
    assert not EngineArgs(
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}
    ).kv_events.publishes


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-pp", "2"], "'2' is refused: Weir splits a model across GPUs by tensor parallelism"),
        (["--pipeline_parallel_size=2"], "-pp/--pipeline-parallel-size: '2' is refused"),
        (["--tokenizer-mode", "mistral"], "'mistral' is refused: Weir reads the model's tokenizer"),
        (["--tokenizer-mode", "slow"], "and has no slow or mistral_common tokenizer"),
        (["--limit-mm-per-prompt", '{"video": 1}'], "(Weir reads images only)"),
        (["--quantization", "marlin"], "no marlin matmul kernels and reads no such checkpoint"),
        (["--quantization", "gguf"], "'gguf' is refused: Weir has no gguf matmul kernels"),
        (["--revision", "v1.1"], "'v1.1' is refused: Weir reads the model's files as they are"),
        (["--tokenizer-revision", "dev"], "'dev' is refused: Weir reads the tokenizer's files"),
        (["--distributed-executor-backend", "ray"], "'ray' is refused: Weir's executors are"),
        (["--distributed_executor_backend=external_launcher"], "`weir executor` (a Kubernetes"),
        (["--cpu-offload-gb", "8"], "'8' is refused: Weir keeps a model's weights on the device"),
        (
            ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
            "is refused: Weir has no disaggregated prefill",
        ),
        (["--load-format", "bitsandbytes"], "'bitsandbytes' is refused: Weir has no bitsandbytes"),
        (["--load-format", "pt"], "Weir reads safetensors weights only (pt: a .bin checkpoint"),
        (["--load-format", "mistral"], "not Mistral's consolidated ones (params.json)"),
        (["--load-format", "runai_streamer"], "from its local directory itself"),
        (["--load-format", "gguf"], "--load-format gguf reads a .gguf file: give one as the"),
        (["--enable-reasoning"], "--enable-reasoning is refused without --reasoning-parser"),
        (["--task", "reward"], "'reward' is refused: Weir's runners generate text"),
        (["--num-scheduler-steps", "8"], "'8' is refused: Weir schedules every step"),
        (["--scheduler-delay-factor", "0.5"], "Weir schedules a waiting prompt at the first"),
        (["--enable-expert-parallel"], "--enable-expert-parallel is refused: Weir splits every"),
        (["--compilation-config", '{"level": 3}'], "Weir compiles nothing with torch.compile"),
        (["--cuda-graph-sizes", "512"], "'512' is refused: Weir compiles nothing"),
        (["--guided-decoding-backend", "outlines"], "Weir's structured outputs are xgrammar's"),
        (["--chat-template-content-format", "openai"], "its text parts joined by newlines"),
        (["--logits-processor-pattern", "my.procs.*"], "Weir loads no logits processor"),
        (["--rope-scaling", "yarn"], "--rope-scaling is not JSON"),
        (["--kv-events-config", '{"enable_kv_cache_events": 1}'], "must be a bool, got 1"),
        (["--kv-events-config", '{"publisher": "kafka"}'], "publisher must be one of ('zmq'"),
        (["--kv-events-config", '{"endpoint": "localhost:5557"}'], "must be a ZeroMQ address"),
        (["--kv-events-config", '{"buffer_step": 10}'], "['buffer_step'] not supported"),
        # A factor without its type changed nothing: the model's own rotation was served.
        (["--rope-scaling", '{"factor": 4.0}'], "names no rope_type (linear, llama3, yarn"),
        # Two runners named: the --task one was served, the --runner one silently dropped.
        (["--task", "embed", "--runner", "generate"], "task is the runner pooling, not --runner"),
    ],
)
def test_vllm_flags_weir_cannot_honour_end_with_status_2_saying_why(
    tiny_model_dir, capsys, flags, message
):
    with pytest.raises(SystemExit) as exit_info:
        _engine_args(parse_args(["serve", str(tiny_model_dir), *flags]))
    assert exit_info.value.code == 2
    # One line (after argparse's usage) says why.
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_vllms_older_flags_are_taken_and_refused_from_a_config_file(
    tiny_model_dir, tmp_path, capsys
):
    """--task is the runner it names; a refused switch is refused from the file too."""
    taken = tmp_path / "taken.yaml"
    taken.write_text(
        "task: embed\nenable-reasoning: true\nreasoning_parser: deepseek_r1\n"
        "num_scheduler_steps: 1\nuse-v2-block-manager: true\n"
    )
    args = parse_args(["serve", str(tiny_model_dir), "--config", str(taken)])
    assert _engine_args(args).runner == "pooling" and args.use_v2_block_manager
    # A refused switch's false is its default, as vLLM takes it (a traceback before).
    untaken = tmp_path / "untaken.yaml"
    untaken.write_text("enable_expert_parallel: false\nenable-server-load-tracking: false\n")
    args = parse_args(["serve", str(tiny_model_dir), "--config", str(untaken)])
    assert not args.enable_server_load_tracking and "enable_expert_parallel" not in vars(args)
    refused = tmp_path / "refused.yaml"
    refused.write_text("enable_expert_parallel: true\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", str(tiny_model_dir), "--config", str(refused)])
    assert exit_info.value.code == 2
    assert "--enable-expert-parallel is refused: Weir splits" in capsys.readouterr().err


def test_rope_scaling_is_hf_overrides_over_the_models_config(tiny_model_dir):
    """vLLM's --rope-scaling replaces config.json's rope_scaling, over --hf-overrides' own, in
    the config the engine reads."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    linear = {"rope_type": "linear", "factor": 2.0}
    args = parse_args(
        ["serve", str(tiny_model_dir), "--hf-overrides", json.dumps(
            {"max_position_embeddings": 256, "rope_scaling": linear}),
         "--rope-scaling", json.dumps(yarn)]
    )  # fmt: skip
    overrides = _engine_args(args).hf_overrides
    assert json.loads(overrides) == {"max_position_embeddings": 256, "rope_scaling": yarn}
    rope = read_model_config(tiny_model_dir, overrides).rope
    assert (rope.type, rope.factor, rope.original_max_position) == ("yarn", 4.0, 256)


def test_download_dir_is_refused_without_a_model(capsys):
    """Weir reads a model given where it is; only the bundled default is fetched, into
    $WEIR_CACHE."""
    with pytest.raises(SystemExit) as exit_info:
        _engine_args(parse_args(["serve", "--download-dir", "/data/hf"]))
    assert exit_info.value.code == 2
    assert "--download-dir is refused without a model" in capsys.readouterr().err


def test_the_deployment_flags_are_taken_and_refused_from_a_config_file(tmp_path, capsys):
    """vLLM's --config YAML, its keys spelt either way."""
    taken = tmp_path / "taken.yaml"
    taken.write_text(
        "download_dir: /data/hf\nrevision: main\ndistributed-executor-backend: mp\n"
        "cpu_offload_gb: 0\nmax-seq-len-to-capture: 8192\nload_format: safetensors\n"
        "enable-server-load-tracking: true\n"
    )
    args = parse_args(["serve", "/models/m", "--config", str(taken)])
    assert (args.download_dir, args.revision, args.distributed_executor_backend) == (
        "/data/hf",
        "main",
        "mp",
    )
    assert args.cpu_offload_gb == 0 and args.max_seq_len_to_capture == 8192
    assert args.load_format == "safetensors" and args.enable_server_load_tracking
    refused = tmp_path / "refused.yaml"
    refused.write_text("kv_transfer_config: {kv_connector: LMCacheConnectorV1, kv_role: kv_both}\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "/models/m", "--config", str(refused)])
    assert exit_info.value.code == 2
    assert "Weir has no disaggregated prefill" in capsys.readouterr().err
