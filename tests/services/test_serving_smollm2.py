"""The default model (SmolLM2-135M-Instruct) served end to end: chat prompts over the SDK
decode exactly like transformers."""

import json
import subprocess
import sys

import pytest
import torch
from serving_helpers import hf_constrained

from weir.services.launcher import ServerProcesses
from weir.shared.client import WeirClient
from weir.shared.config import EngineArgs
from weir.shared.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NUM_NEW = 12
CHATS = ["What is the capital of France?", "Name a colour of the rainbow."]


def test_smollm2_chat_over_the_sdk_matches_transformers(default_model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: EOS is an ordinary token
    conversations = [[{"role": "user", "content": text}] for text in CHATS]
    want = []
    with torch.no_grad():
        for messages in conversations:
            ids = list(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=NUM_NEW,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
            want.append((ids, out[0, len(ids) :].tolist()))

    # A JSON schema held by transformers with xgrammar's own logits processor: the
    # reference for the served structured output.
    import xgrammar as xgr

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    json_chat = [
        {"role": "user", "content": "Describe Paris as JSON with its city name and population."}
    ]
    json_ids = list(
        tokenizer.apply_chat_template(
            json_chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    want_json = hf_constrained(model, json_ids, 60, grammar, tokenizer.eos_token_id)
    assert want_json[-1] == tokenizer.eos_token_id, "the reference must complete its JSON"

    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    options = {"model": None, "kv_cache_memory": "32MiB", "max_num_batched_tokens": 256}
    with ServerProcesses(
        EngineArgs(**options), port=0, metrics_port=0, executor_metrics_port=0
    ) as server:
        with WeirClient(server.client_address) as client:
            assert client.model_info()["model_name"] == "SmolLM2-135M-Instruct"
            for messages, (prompt_ids, want_ids) in zip(conversations, want):
                outs = list(client.generate(messages, params))
                assert outs[0].prompt_token_ids == prompt_ids
                token_ids = [t for o in outs for t in o.new_token_ids]
                assert token_ids == want_ids
                assert "".join(o.text for o in outs) == tokenizer.decode(
                    token_ids, skip_special_tokens=True
                )
            constrained = SamplingParams(
                max_tokens=60, temperature=0.0, structured_output={"json": schema}
            )
            outs = list(client.generate(json_chat, constrained))
            assert [t for o in outs for t in o.new_token_ids] == want_json
            document = json.loads("".join(o.text for o in outs))
            assert set(document) == {"city", "population"} and outs[-1].finish_reason == "stop"
            # JSON mode is an object, as OpenAI's: here any JSON value would be an array
            # ("[1,2,3,4,5,6,7,8,9,10]", xgrammar's built-in JSON grammar in transformers).
            as_object = SamplingParams(
                max_tokens=8, temperature=0.0, structured_output={"json_object": True}
            )
            outs = list(client.generate("A JSON list of numbers:", as_object))
            assert "".join(o.text for o in outs).startswith("{")
            # `weir chat` on piped input: a refused turn is an error line on stderr and a
            # failing exit status, the next turn still answered.
            chat = subprocess.run(
                [sys.executable, "-m", "weir.services.cli", "chat", "--address"]
                + [server.client_address, "--max-tokens", "3", "--temperature", "0"],
                input="x" * 40_000 + "\nWhat is the capital of France?\n",
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert chat.returncode == 1, chat.stderr
            assert chat.stderr.startswith("weir chat: ") and chat.stderr.count("\n") == 1
            assert "The capital" in chat.stdout or "Paris" in chat.stdout, chat.stdout
