"""`weir run-batch`: a file of OpenAI batch requests, answered by engines it starts itself,
each line's output in the input's order; greedy answers equal transformers', and every bad
line gets its own error line while the others are answered."""

import json
import shutil
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from serving_helpers import hf_greedy

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CHATS = {  # custom_id: (question, max_tokens); the first runs longest, so finishes last
    "france": ("What is the capital of France?", 24),
    "haiku": ("Write a haiku about the sea.", 6),
    "primes": ("List three prime numbers greater than 10.", 9),
}
COMPLETION = ("sky", "The sky is", 7)


class _Files(BaseHTTPRequestHandler):
    """A web server of files: GET serves one, PUT stores one (as object stores do)."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        if data is not None and self.path.endswith(".cut"):  # a connection lost mid-body
            self.send_header("Content-Length", str(len(data) + 100))
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def web():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Files.files
    server.shutdown()
    server.server_close()


def _line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _run_batch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weir.services.cli", "run-batch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _started(*args: str) -> subprocess.Popen[str]:
    """`weir run-batch ARGS`, returned once it logs its first request: its engines are up
    and the batch is under way. Read the rest of its stderr from ``.stderr``."""
    run = subprocess.Popen(
        [sys.executable, "-m", "weir.services.cli", "run-batch", *args, "--enable-log-requests"],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in run.stderr:
        if "weir.requests: request" in line:
            break
    return run


@pytest.fixture(scope="module")
def reference_tokens(default_model_dir):
    """transformers' greedy token ids for each chat and the completion (EOS ignored, as the
    batch's lines ask)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    ).eval()
    prompts = {
        custom_id: (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"],
            max_tokens,
        )
        for custom_id, (question, max_tokens) in CHATS.items()
    }
    custom_id, text, max_tokens = COMPLETION
    prompts[custom_id] = (tokenizer(text)["input_ids"], max_tokens)
    return {key: hf_greedy(model, list(ids), n) for key, (ids, n) in prompts.items()}


def test_a_batch_file_is_answered_in_order_and_bad_lines_get_errors(
    default_model_dir, tmp_path, web, reference_tokens
):
    base, files = web
    model = Path(default_model_dir).name
    lines = [
        _line(
            custom_id,
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        for custom_id, (question, max_tokens) in CHATS.items()
    ]
    custom_id, text, max_tokens = COMPLETION
    lines.append(
        _line(
            custom_id,
            "/v1/completions",
            {
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
    )
    lines += [
        "",  # blank lines are skipped, as vLLM skips them
        _line("no-model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}),
        _line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
        "{not json",
        _line("audio", "/v1/audio/transcriptions", {}),
        _line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        _line("haiku", "/v1/completions", {"prompt": "x"}),  # a custom_id already used
        _line("negative", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
        _line("embedding", "/v1/embeddings", {"input": "x"}),  # a text model's server
        _line("streamed-1", "/v1/completions", {"prompt": "x", "stream": 1}),  # the API's true
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")

    config = tmp_path / "engine.yaml"  # vLLM's --config: the engine's flags in a file
    config.write_text(f"model: {default_model_dir}\nmax-model-len: 512\n")
    done = _run_batch("-i", str(source), "-o", f"{base}/results.jsonl", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "13 requests, 4 succeeded, 9 failed" in done.stderr
    results = [json.loads(line) for line in files["/results.jsonl"].decode().splitlines()]
    assert [r["custom_id"] for r in results] == [
        *CHATS, "sky", "no-model", "streamed", None, "audio", "get", "haiku", "negative",
        "embedding", "streamed-1",
    ]  # fmt: skip
    assert len({r["id"] for r in results}) == len(results)

    for result in results[:4]:
        assert result["error"] is None
        response = result["response"]
        assert response["status_code"] == 200
        choice = response["body"]["choices"][0]
        assert choice["token_ids"] == reference_tokens[result["custom_id"]], result["custom_id"]
        assert response["body"]["id"].endswith(response["request_id"])
    assert results[0]["response"]["body"]["choices"][0]["message"]["content"]

    answered = {r["custom_id"]: r for r in results[4:] if r["response"] is not None}
    assert {k: r["response"]["status_code"] for k, r in answered.items()} == {
        "no-model": 404,
        "negative": 400,
        "embedding": 400,
    }
    for r in answered.values():  # the API's error, whole in the body and in `error`
        assert r["error"] == r["response"]["body"]["error"]
    assert "max_tokens" in answered["negative"]["error"]["message"]
    assert "--runner pooling" in answered["embedding"]["error"]["message"]

    refused = {r["custom_id"]: r["error"]["message"] for r in results[4:] if r["response"] is None}
    assert refused == {
        "streamed": "line 7: stream is not served in a batch (one whole body a line)",
        None: refused[None],
        "audio": refused["audio"],
        "get": "line 10: method must be 'POST', got 'GET'",
        "haiku": "line 11: custom_id 'haiku' repeats an earlier one",
        "streamed-1": "line 14: stream is not served in a batch (one whole body a line)",
    }
    assert refused[None].startswith("line 8 is not JSON")
    assert refused["audio"].startswith("line 9: url '/v1/audio/transcriptions' is none of")


def test_an_input_that_cannot_be_read_fails_before_any_engine_starts(web, tmp_path):
    base, _ = web
    for source in (str(tmp_path / "missing.jsonl"), f"{base}/missing.jsonl"):
        done = _run_batch("-i", source, "-o", str(tmp_path / "out.jsonl"), timeout=60)
        assert done.returncode == 2
        assert f"--input-file {source}:" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_an_engine_that_fails_to_start_leaves_the_output_as_it_was(tiny_model_dir, tmp_path):
    """The engines start before the output is emptied (vLLM's order): weights that cannot be
    read end the run with status 1, the earlier results kept; an output that cannot be
    written is found before any engine starts."""
    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"not safetensors")
    source = tmp_path / "batch.jsonl"
    source.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    output = tmp_path / "results.jsonl"
    output.write_text("earlier results\n")
    done = _run_batch("-i", str(source), "-o", str(output), "--model", str(model), timeout=120)
    assert done.returncode == 1, done.stderr
    assert output.read_text() == "earlier results\n"
    done = _run_batch("-i", str(source), "-o", str(tmp_path), "--model", str(model), timeout=60)
    assert done.returncode == 1
    assert "Is a directory" in done.stderr
    assert "executor" not in done.stderr and "Traceback" not in done.stderr


def test_an_input_whose_connection_closes_mid_body_fails_the_run(web, tiny_model_dir, tmp_path):
    base, files = web
    files["/batch.jsonl.cut"] = (_line("a", "/v1/completions", {"prompt": "x"}) + "\n").encode()
    done = _run_batch("-i", f"{base}/batch.jsonl.cut", "-o", str(tmp_path / "out.jsonl"),
                      "--model", str(tiny_model_dir), timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert "failed after line 1: its connection closed before the whole body came" in done.stderr


def test_an_output_that_is_the_input_is_refused_before_it_is_emptied(tmp_path):
    source = tmp_path / "batch.jsonl"
    requests = _line("a", "/v1/completions", {"prompt": "x"}) + "\n"
    source.write_text(requests)
    (tmp_path / "link.jsonl").symlink_to(source)
    done = _run_batch("-i", str(source), "-o", str(tmp_path / "link.jsonl"), timeout=60)
    assert done.returncode == 2
    assert "is the input file" in done.stderr
    assert source.read_text() == requests


def test_a_scheduler_killed_mid_batch_fails_the_run_and_leaves_no_line_unanswered(
    default_model_dir, tmp_path
):
    psutil = pytest.importorskip("psutil")
    body = {"prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True}
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(_line(str(i), "/v1/completions", body) + "\n" for i in range(8)))
    output = tmp_path / "results.jsonl"
    run = _started(
        "-i", str(source), "-o", str(output), "--model", default_model_dir,
        "--max-model-len", "512",
    )  # fmt: skip
    try:
        (scheduler,) = [
            child for child in psutil.Process(run.pid).children() if "scheduler" in child.cmdline()
        ]
        scheduler.kill()
        assert run.wait(timeout=120) == 1
        rest = run.stderr.read()
    finally:
        run.kill()
        run.wait()
    assert "the engine stopped: scheduler exited with code -9" in rest
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [str(i) for i in range(8)]
    for r in results:
        assert r["response"]["status_code"] == 503
        assert r["error"]["code"] == "server_unavailable"


def test_sigterm_mid_batch_stops_it_leaving_the_answered_lines(tiny_model_dir, tmp_path):
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True}
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(_line(str(i), "/v1/completions", body) + "\n" for i in range(64)))
    output = tmp_path / "results.jsonl"
    run = _started(
        "-i", str(source), "-o", str(output), "--model", str(tiny_model_dir),
        "--max-num-seqs", "4",  # 8 in flight: the rest wait for them
    )  # fmt: skip
    try:
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 130
        rest = run.stderr.read()
    finally:
        run.kill()
        run.wait()
    assert "stopped before the last line" in rest and "Traceback" not in rest
    results = [json.loads(line) for line in output.read_text().splitlines()]
    # In order, and only answers: the lines in flight have none, not the closing's errors.
    assert [r["custom_id"] for r in results] == [str(i) for i in range(len(results))]
    assert len(results) < 64
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_data_parallel_engines_answer_one_batch(tiny_model_dir, tiny_hf_model, tmp_path):
    """--data-parallel-size 2: two schedulers, each with its executor, behind the batch's one
    in-process API; every line answered as transformers decodes it, in the input's order."""
    psutil = pytest.importorskip("psutil")
    prompts = [[5 + i, 6, 7, 8 + i, 9] for i in range(8)]
    greedy = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    source = tmp_path / "batch.jsonl"
    source.write_text(
        "".join(
            _line(str(i), "/v1/completions", {"prompt": p, **greedy}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    output = tmp_path / "results.jsonl"
    run = _started(
        "-i", str(source), "-o", str(output), "--model", str(tiny_model_dir),
        "--data-parallel-size", "2", "--kv-cache-memory", "1MiB",
    )  # fmt: skip
    try:
        children = [c.cmdline() for c in psutil.Process(run.pid).children()]
        assert sum("scheduler" in c for c in children) == 2
        assert run.wait(timeout=120) == 0, run.stderr.read()
    finally:
        run.kill()
        run.wait()
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [str(i) for i in range(8)]
    assert [r["response"]["body"]["choices"][0]["token_ids"] for r in results] == [
        hf_greedy(tiny_hf_model, p, 6) for p in prompts
    ]


def test_an_output_fifo_is_opened_once_and_a_dangling_symlink_left_dangling(tmp_path):
    """The output check before the engines start opens no FIFO (its reader would take that
    open's close for the end of its input, and the results' open then wait for a reader
    forever: `mkfifo out; cat out & weir run-batch -o out` never ended), and a symlink to a
    missing file is left as it was."""
    import os

    from weir.services.batch import check_output

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    checked = threading.Thread(target=check_output, args=(str(fifo),), daemon=True)
    checked.start()
    checked.join(timeout=5)
    if checked.is_alive():  # blocked in open(): a reader lets it end
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("check_output opened the FIFO")
    fifo.chmod(0o400)
    if not os.access(fifo, os.W_OK):  # (root may write any file)
        with pytest.raises(PermissionError):
            check_output(str(fifo))
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "target.jsonl")
    check_output(str(link))
    assert link.is_symlink() and not (tmp_path / "target.jsonl").exists()
