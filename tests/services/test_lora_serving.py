"""LoRA adapters served by `weir serve` on the default model, as vLLM serves them: each
adapter is asked for as the model (HTTP) or by ``lora_name`` (SDK, ``LLM``), requests of
several adapters and of the base model run together, and each decodes what PEFT's model
of the same adapter decodes with transformers."""

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from lora_adapters import ALL_PROJECTIONS, peft_model, save_random_adapter
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from serving_helpers import hf_greedy, read_metrics, small_server

from weir.services import LLM
from weir.services.cli import main
from weir.services.launcher import ChildFailedError, GatewayProcess
from weir.shared.client import InvalidRequestError, WeirClient
from weir.shared.sampling import SamplingParams

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MODEL = "smol"
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": save_random_adapter(
            default_model_dir,
            root / "sql",
            seed=1,
            targets=["q_proj", "v_proj", "o_proj", "down_proj"],
            rank=8,
            alpha=16,
        ),
        "poet": save_random_adapter(
            default_model_dir,
            root / "poet",
            seed=2,
            targets=ALL_PROJECTIONS,
            rank=4,
            alpha=8,
            rslora=True,
        ),
    }


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    long = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4
    return [tokenizer(text).input_ids for text in ("The capital of France is", long)]


@pytest.fixture(scope="module")
def references(default_model_dir, adapters, prompts):
    """PEFT's greedy tokens of every prompt, per model name (None: the base model); each pass
    computes the LM head at the last position only."""
    out = {}
    for name in (None, *adapters):
        model = peft_model(default_model_dir, adapters.get(name))
        out[name] = [hf_greedy(model, prompt, NUM_TOKENS) for prompt in prompts]
    assert out["sql"] != out[None] and out["poet"] != out[None], "adapters must matter"
    return out


@pytest.fixture(scope="module")
def server(default_model_dir, adapters):
    # One adapter at a time: requests of the other wait while those of the base model run.
    modules = [f"{name}={path}" for name, path in adapters.items()]
    with small_server(default_model_dir, MODEL, lora_modules=modules, max_loras=1) as processes:
        yield processes


def test_every_model_name_decodes_as_peft_does_in_shared_steps(server, prompts, references):
    """The long prompt (chunked at 64 tokens a step) runs under the base model first, so its
    blocks are cached when the adapters ask for the same prompt: they must not read them."""
    client = openai.AsyncOpenAI(base_url=server.info["http_address"] + "/v1", api_key="-")

    async def complete(name, prompt):
        reply = await client.completions.create(
            model=name or MODEL,
            prompt=prompt,
            max_tokens=NUM_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return reply.model, reply.choices[0].token_ids

    async def everything():
        first = await complete(None, prompts[1])
        names = [None, "sql", "poet"] * 2
        rest = await asyncio.gather(
            *(complete(name, prompt) for name in names for prompt in prompts)
        )
        return first, dict(zip([(n, i) for n in names for i in range(2)], rest))

    first, got = asyncio.run(everything())
    assert first == (MODEL, references[None][1])
    for (name, i), (model, tokens) in got.items():
        assert model == (name or MODEL)
        assert tokens == references[name][i], (name, i)


def test_the_models_endpoint_lists_each_adapter_under_its_parent(server):
    base = server.info["http_address"]
    listing = httpx.get(base + "/v1/models").json()["data"]
    assert [(card["id"], card["parent"]) for card in listing] == [
        (MODEL, None),
        ("sql", MODEL),
        ("poet", MODEL),
    ]
    assert httpx.get(base + "/v1/models/poet").json()["parent"] == MODEL
    # The gateway's metrics name the route by its template (it was "other").
    samples = read_metrics(base + "/metrics")
    assert samples['weir_gateway_requests_total{route="/v1/models/{name}",status="200"}'] >= 1
    missing = httpx.post(
        base + "/v1/chat/completions",
        json={"model": "prose", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == (
        f"The model `prose` does not exist; this server serves `{MODEL}` and the LoRA adapters "
        "`sql`, `poet`."
    )


def test_a_streamed_chat_of_an_adapter_is_named_by_it(server):
    client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="-")
    chunks = list(
        client.chat.completions.create(
            model="poet",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert chunks and {chunk.model for chunk in chunks} == {"poet"}


def test_the_sdk_names_an_adapter_by_lora_name(server, prompts, references):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    with WeirClient(server.client_address) as client:
        tokens = [
            t
            for out in client.generate(prompts[0], params, lora_name="sql")
            for t in out.new_token_ids
        ]
        assert tokens == references["sql"][0]
        with pytest.raises(InvalidRequestError) as refused:
            list(client.generate("hi", params, lora_name="prose"))
        assert str(refused.value) == (
            "lora_name 'prose': this server has no such LoRA adapter; it serves ['sql', 'poet'] "
            "(--lora-modules NAME=PATH)"
        )
        assert client.model_info()["lora_names"] == ["sql", "poet"]


def test_the_scheduler_counts_each_adapters_requests(server):
    url = server.info["metrics_address"]

    def counts():
        samples = read_metrics(url)
        return {
            (state, name): samples[
                f'weir_lora_requests_{state}{{lora_name="{name}",model_name="{MODEL}"}}'
            ]
            for state in ("running", "waiting")
            for name in ("sql", "poet")
        }

    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with WeirClient(server.client_address) as client:
        stream = client.generate("Tell me a story.", params, lora_name="poet")
        next(stream)
        assert counts() == {
            ("running", "sql"): 0,
            ("running", "poet"): 1,
            ("waiting", "sql"): 0,
            ("waiting", "poet"): 0,
        }
        # --max-loras 1: a request of the other adapter waits while poet's runs.
        body = {"model": "sql", "prompt": "Write a query.", "max_tokens": 1}
        completions = server.info["http_address"] + "/v1/completions"
        waiting = threading.Thread(
            target=httpx.post, args=(completions,), kwargs={"json": body, "timeout": 60}
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while counts()[("waiting", "sql")] != 1:
            assert time.monotonic() < deadline, counts()
            time.sleep(0.05)
        expected = {
            "model_name": MODEL,
            "max_lora": "1",
            "running_lora_adapters": "poet",
            "waiting_lora_adapters": "sql",
            "engine": "0",
        }
        # The API port reads the engine's series at most once a second: a scrape within a
        # second of another may show the engine as it was then.
        deadline = time.monotonic() + 5
        while True:
            before = time.time()
            info = _lora_info(server.info["http_address"] + "/metrics")
            if info.labels == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert info.labels == expected
        assert before - 2 <= info.value <= time.time() + 1, info
        stream.close()
        waiting.join(timeout=60)
    deadline = time.monotonic() + 10
    while set(counts().values()) != {0}:  # the abort reaches the scheduler soon after
        assert time.monotonic() < deadline, counts()
        time.sleep(0.05)


def _lora_info(url: str) -> Sample:
    """The one sample of vLLM's lora_requests_info as the gateway's /metrics (the API port an
    endpoint picker scrapes) serves it."""
    text = httpx.get(url, timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [sample] = families["weir_lora_requests_info"].samples
    return sample


def test_weir_generate_takes_an_adapter(server, default_model_dir, references, capsys):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    argv = ["generate", "The capital of France is", "--address", server.client_address]
    argv += ["--max-tokens", str(NUM_TOKENS), "--ignore-eos", "--lora-name", "poet"]
    assert main(argv) == 0
    assert capsys.readouterr().out == tokenizer.decode(references["poet"][0]) + "\n"


def test_llm_takes_an_adapter_per_prompt(default_model_dir, adapters, prompts, references):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    names = [None, "poet", "sql", "poet"]
    with LLM(
        str(default_model_dir), lora_modules=modules, max_loras=2, max_model_len=512, device="cpu"
    ) as llm:
        got = llm.generate(
            [prompts[0]] * 4,
            SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
            lora_name=names,
        )
        with pytest.raises(TypeError, match="lora_name must be an adapter's name, None, or a list"):
            llm.generate(prompts[0], lora_name=7)
    assert [c.token_ids for c in got] == [references[name][0] for name in names]


def test_an_adapter_weir_cannot_serve_stops_the_start(default_model_dir, adapters, tmp_path):
    config = (adapters["sql"] / "adapter_config.json").read_text()
    (tmp_path / "adapter_config.json").write_text(
        config.replace('"use_dora": false', '"use_dora": true')
    )
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (adapters["sql"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(ChildFailedError, match="use_dora \\(DoRA\\) is not supported"):
        with small_server(default_model_dir, MODEL, lora_modules=[f"dora={tmp_path}"]):
            pass


@pytest.fixture(scope="module")
def runtime_server(default_model_dir):
    with small_server(
        default_model_dir, MODEL, allow_runtime_lora_updating=True, max_loras=2
    ) as processes:
        yield processes


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.info["http_address"] + route, json=body, timeout=60)


def _complete(server, name: str, prompt: list[int]) -> list[int]:
    reply = _post(
        server,
        "/v1/completions",
        {
            "model": name,
            "prompt": prompt,
            "max_tokens": NUM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_adapters_loaded_and_unloaded_at_runtime_as_vllm_does(
    runtime_server, adapters, prompts, references
):
    server = runtime_server

    def models():
        cards = httpx.get(server.info["http_address"] + "/v1/models").json()["data"]
        return [card["id"] for card in cards]

    assert models() == [MODEL]
    loaded = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    )
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'sql' added successfully.",
    )
    assert models() == [MODEL, "sql"]
    assert _complete(server, "sql", prompts[1]) == references["sql"][1]
    again = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["poet"])}
    )
    assert again.status_code == 400
    assert (
        again.json()["error"]["message"]
        == "the LoRA adapter 'sql' is already loaded: unload it first"
    )
    # New weights under the same name: the old adapter's cached blocks of the prompt are not
    # its blocks.
    unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'sql' removed successfully.",
    )
    # Gone at once for the routes that name a model (the gateway's list was kept).
    base = server.info["http_address"]
    assert httpx.get(base + "/v1/models/sql").status_code == 404
    assert _post(server, "/tokenize", {"model": "sql", "prompt": "hi"}).status_code == 404
    assert models() == [MODEL]
    assert (
        _post(
            server,
            "/v1/load_lora_adapter",
            {"lora_name": "sql", "lora_path": str(adapters["poet"])},
        ).status_code
        == 200
    )
    assert _complete(server, "sql", prompts[1]) == references["poet"][1]
    missing = _post(server, "/v1/unload_lora_adapter", {"lora_name": "prose"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "the LoRA adapter 'prose' is not loaded"


def test_an_unload_waits_for_the_adapters_requests_and_takes_no_new_one(
    runtime_server, adapters, prompts, references
):
    """A request in flight keeps its adapter to the end; meanwhile a new request of it is
    refused (a 404 over HTTP), so a steady flow of them cannot hold the unload off."""
    server = runtime_server
    _post(server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(adapters["sql"])})
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with WeirClient(server.client_address) as client:
        stream = client.generate(prompts[0], params, lora_name="busy")
        tokens = list(next(stream).new_token_ids)
        unloading = threading.Thread(
            target=_post, args=(server, "/v1/unload_lora_adapter", {"lora_name": "busy"})
        )
        unloading.start()
        deadline = time.monotonic() + 10
        while True:  # until the unload has begun
            refused = _post(
                server, "/v1/completions", {"model": "busy", "prompt": "hi", "max_tokens": 2}
            )
            if refused.status_code == 404:
                break
            assert time.monotonic() < deadline, refused.text
        assert refused.json()["error"]["message"] == (
            "lora_name 'busy': the LoRA adapter is being unloaded"
        )
        tokens += [t for out in stream for t in out.new_token_ids]
        unloading.join(timeout=30)
        assert not unloading.is_alive()
        assert "busy" not in client.model_info()["lora_names"]
    assert tokens[:NUM_TOKENS] == references["sql"][0] and len(tokens) == 60


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (
            {"lora_name": "x", "lora_path": "/nowhere"},
            400,
            "LoRA adapter /nowhere: no adapter_config.json there",
        ),
        ({"lora_name": "a b", "lora_path": "/x"}, 400, "lora_name 'a b' must be"),
        (
            {"lora_name": MODEL, "lora_path": "/x"},
            400,
            "lora_name 'smol' is the served model's name",
        ),
        ({"lora_name": "x", "lora_path": "/x", "load_inplace": True}, 400, "load_inplace"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ],
)
def test_an_adapter_that_cannot_be_loaded_is_a_400(runtime_server, body, status, message):
    reply = _post(runtime_server, "/v1/load_lora_adapter", body)
    assert reply.status_code == status and message in reply.json()["error"]["message"]


def test_without_runtime_updating_loading_is_refused(server, adapters):
    reply = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["sql"])}
    )
    assert reply.status_code == 400
    assert "start it with --allow-runtime-lora-updating" in reply.json()["error"]["message"]


def test_a_runtime_adapter_survives_its_executors_death(
    runtime_server, adapters, prompts, references
):
    """The executor that replaces a killed one gets the adapters loaded since start-up."""
    server = runtime_server
    _post(
        server, "/v1/load_lora_adapter", {"lora_name": "again", "lora_path": str(adapters["sql"])}
    )
    assert _complete(server, "again", prompts[0]) == references["sql"][0]
    os.kill(server.info["executors"][0]["pid"], signal.SIGKILL)
    # Sent after the kill, the request is served by the executor that replaces the killed one
    # (it waits out the loss and the recovery, whether or not the loss was noticed yet: a
    # wait for a status that is not "ok" could miss a recovery faster than its polls).
    assert _complete(server, "again", prompts[0]) == references["sql"][0]


def test_another_gateway_sees_adapters_come_and_go(runtime_server, adapters):
    """Gateways ask the scheduler, not their memory: one that did not load the adapter
    lists it, serves it, and answers a 404 once it is unloaded through another."""
    with GatewayProcess([runtime_server.client_address]) as other:
        base = other.info["http_address"]

        def listed() -> list[str]:
            return [card["id"] for card in httpx.get(base + "/v1/models").json()["data"]]

        assert "far" not in listed()
        loaded = {"lora_name": "far", "lora_path": str(adapters["poet"])}
        assert _post(runtime_server, "/v1/load_lora_adapter", loaded).status_code == 200
        assert "far" in listed()
        body = {"model": "far", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        gone = {"lora_name": "far"}
        assert _post(runtime_server, "/v1/unload_lora_adapter", gone).status_code == 200
        missing = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "far" not in listed()
