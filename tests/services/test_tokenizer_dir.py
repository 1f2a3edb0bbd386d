"""vLLM's `--tokenizer DIR`: a model served with another directory's tokenizer, as a .gguf
model is served with its original Hugging Face tokenizer. The tokenizer here is the default
model's with another chat template, another end token and a token renamed, so every answer
tells which tokenizer made it; transformers, loading that directory itself, is the
reference."""

import json
import signal
import subprocess
import sys

import httpx
import pytest
import yaml
from test_serving_processes import read_until, start_serve

from weir.services.cli import _engine_args, parse_args
from weir.services.llm import LLM
from weir.shared.config import EXECUTOR, SCHEDULER, EngineArgs
from weir.shared.model_store import default_gguf_path
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import served_tokenizer

transformers = pytest.importorskip("transformers")

# Renders what the default model's template does not: role names in capitals, and the
# tokenizer's own end token (its eos_token variable) after each message.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
EOS = "<|endoftext|>"  # id 0; the model's own end token is <|im_end|>, id 2
RENAMED = ("<repo_name>", "<|tool|>")  # one special token (id 3), named otherwise
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, default_model_dir):
    """The default model's tokenizer, saved by transformers with the changes above."""
    path = tmp_path_factory.mktemp("tokenizers") / "other"
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.eos_token = EOS
    tokenizer.save_pretrained(path)
    old, new = RENAMED
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = path / name
        file.write_text(file.read_text().replace(json.dumps(old), json.dumps(new)))
    return path


@pytest.fixture(scope="module")
def other(other_dir):
    return transformers.AutoTokenizer.from_pretrained(other_dir)


@pytest.fixture(scope="module")
def own(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def http(other_dir):
    """`weir serve MODEL.gguf --tokenizer DIR`, the command line of vLLM's GGUF guide."""
    proc = start_serve(
        default_gguf_path(),
        *("--tokenizer", str(other_dir), "--kv-cache-memory", "8MiB", "--max-model-len", "128"),
        *("--http-port", "0", "--device", "cpu"),
    )
    try:
        banner = read_until(proc, "Press Ctrl-C")
        yield banner.split("HTTP:")[1].split()[0].removesuffix("/v1")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _post(http: str, path: str, body: dict) -> dict:
    reply = httpx.post(http + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_chats_render_with_the_given_tokenizers_template_and_tokens(http, other, own):
    want = other.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert want != own.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert _post(http, "/tokenize", {"messages": CHAT})["tokens"] == want
    chat = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(want)
    text = f"{RENAMED[1]} red"
    ids = other(text, add_special_tokens=False)["input_ids"]
    assert ids != own(text, add_special_tokens=False)["input_ids"]
    assert _post(http, "/tokenize", {"prompt": text})["tokens"] == ids
    assert _post(http, "/detokenize", {"tokens": ids})["prompt"] == other.decode(ids)
    # The model keeps its name, not the tokenizer directory's.
    [model] = httpx.get(http + "/v1/models", timeout=30).json()["data"]
    assert model["id"].startswith(default_gguf_path().stem)


def test_the_given_tokenizers_end_token_stops_and_waits_for_min_tokens(http, other):
    """Its eos_token ends a completion, and every executor bans it before min_tokens, as
    the scheduler stops on it: both processes read --tokenizer."""
    end = other.convert_tokens_to_ids(EOS)
    body = {"prompt": "Hi", "max_tokens": 8, "logit_bias": {str(end): 100}}
    ended = _post(http, "/v1/completions", body)["choices"][0]
    assert ended["finish_reason"] == "stop" and ended["text"] == ""
    waited = _post(
        http,
        "/v1/completions",
        {**body, "min_tokens": 3, "logprobs": 0, "return_tokens_as_token_ids": True},
    )
    tokens = waited["choices"][0]["logprobs"]["tokens"]
    assert tokens[3:] == [f"token_id:{end}"] and f"token_id:{end}" not in tokens[:3]
    assert waited["choices"][0]["finish_reason"] == "stop"


def test_bench_serve_tokenizes_its_dataset_with_the_given_tokenizer(
    http, other_dir, other, own, tmp_path
):
    texts = [f"{RENAMED[1]} red", f"{RENAMED[1]}{RENAMED[1]}"]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": t, "output_len": 1}) + "\n" for t in texts))
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "weir.services.cli", "bench", "serve", "--backend", "openai"]
        + ["--base-url", http + "/v1", "--tokenizer", str(other_dir), "--dataset", str(dataset)]
        + ["--no-progress", "--output-json", str(result)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    def count(tokenizer):
        return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)

    assert json.loads(result.read_text())["total_input_tokens"] == count(other) != count(own)


@pytest.fixture(scope="module")
def too_large_dir(tmp_path_factory, other_dir):
    """A tokenizer of one token more than the model has embedding rows for."""
    path = tmp_path_factory.mktemp("tokenizers") / "too-large"
    tokenizer = transformers.AutoTokenizer.from_pretrained(other_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("missing", "no such directory"),
        ("a file", "not a directory"),
        ("no tokenizer.json", "no tokenizer.json in it"),
    ],
)
def test_a_tokenizer_dir_that_is_not_one_ends_serve_with_status_2(
    tmp_path, capsys, other_dir, given, message
):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    path = {
        "missing": tmp_path / "nowhere",
        "a file": other_dir / "tokenizer.json",
        "no tokenizer.json": tmp_path,
    }[given]
    with pytest.raises(SystemExit) as exit_info:
        _engine_args(parse_args(["serve", str(default_gguf_path()), "--tokenizer", str(path)]))
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"weir serve: --tokenizer {str(path)!r}: {message}"), line


def test_a_tokenizer_of_more_tokens_than_the_model_embeds_ends_serve_before_it_starts(
    too_large_dir, default_model_dir
):
    # Fewer tokens than embedding rows is served: a model's rows padded to a multiple of 64.
    assert served_tokenizer(default_model_dir, 49152 + 64, too_large_dir).vocab_size == 49153
    done = subprocess.run(
        [sys.executable, "-m", "weir.services.cli", "serve", str(default_gguf_path())]
        + ["--tokenizer", str(too_large_dir), "--device", "cpu", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"weir serve: --tokenizer {str(too_large_dir)!r}: its vocabulary numbers tokens up to "
        "id 49152, but the model embeds 49152 (ids 0-49151): give the tokenizer of this model "
        "or of its family"
    ]


def test_the_llm_class_takes_tokenizer_as_vllms(tiny_model_dir, other_dir, other, too_large_dir):
    with pytest.raises(ValueError, match="the model embeds 49152"):
        LLM(str(tiny_model_dir), tokenizer=str(too_large_dir))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), tokenizer=str(other_dir), kv_cache_memory="1MiB") as llm:
        [chat] = llm.chat(CHAT, params)
        [text] = llm.generate([RENAMED[1]], params)
        tokenizer = llm.get_tokenizer()
    assert chat.prompt_token_ids == other.apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=False
    )
    assert text.prompt_token_ids == other(RENAMED[1], add_special_tokens=False)["input_ids"]
    assert tokenizer.chat_template == TEMPLATE and tokenizer.eos_token == EOS


def test_the_flag_reaches_every_process_and_a_config_file(tmp_path, other_dir, default_model_dir):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"tokenizer": str(other_dir)}))
    args = EngineArgs(model=str(default_gguf_path()), tokenizer=str(other_dir))
    for role in (SCHEDULER, EXECUTOR):  # every replica's processes get these flags
        argv = args.to_argv(role)
        assert argv[argv.index("--tokenizer") + 1] == str(other_dir)
    assert parse_args(["serve", "--config", str(config)]).tokenizer == str(other_dir)
    batch = parse_args(["run-batch", "-i", "in", "-o", "out", "--tokenizer", str(other_dir)])
    assert _engine_args(batch).tokenizer == str(other_dir)
    # vLLM's default: the model's own tokenizer, which is no other.
    assert (
        EngineArgs(model=str(default_model_dir), tokenizer=str(default_model_dir)).tokenizer is None
    )


def test_named_chat_templates_render_as_transformers_and_bad_configs_are_named(
    tmp_path, other_dir, default_model_dir
):
    """A tokenizer_config.json of transformers' named templates (Command-R's and Hermes'
    tokenizers: a list of {name, template}) renders a chat by "default" and one with tools
    by "tool_use", as transformers does; a chat template or special token of another type
    is a ValueError naming the file (serve: status 2 and one line). Each was a TypeError
    (a traceback from `weir serve --tokenizer`)."""
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer.json").write_bytes((other_dir / "tokenizer.json").read_bytes())
    config = {
        "eos_token": EOS,
        "chat_template": [
            {"name": "default", "template": "D:{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "T:{{ tools | length }}:{{ messages[0]['content'] }}"},
        ],
    }
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    ours = served_tokenizer(default_model_dir, 49152, named)
    theirs = transformers.AutoTokenizer.from_pretrained(named)
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}]
    for given in (None, tools):
        assert ours.apply_chat_template(chat, tools=given) == theirs.apply_chat_template(
            chat, tools=given, tokenize=False
        )
    for bad, message in (
        ({"chat_template": 7}, "chat_template must be a template"),
        ({"eos_token": {"content": 5}}, "a special token must be a string"),
        ({"bos_token": ["<s>"]}, "a special token must be a string"),
    ):
        (named / "tokenizer_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"tokenizer_config.json: {message}"):
            served_tokenizer(default_model_dir, 49152, named)
    # Named templates without a "default" render no chat, as transformers refuses one.
    config["chat_template"] = config["chat_template"][1:]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="or none named 'default'"):
        served_tokenizer(default_model_dir, 49152, named).apply_chat_template(chat)
