"""The offline LLM API: batch generation through real scheduler and executor processes."""

import functools
import gc
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_helpers import exit_code_of_a_fork, hf_greedy, read_metrics

from weir.services import LLM, Completion
from weir.shared.beam_search import BeamSearchParams
from weir.shared.client import (
    ClassificationOutput,
    EmbeddingOutput,
    InvalidRequestError,
    ScoreOutput,
    WeirClient,
    WeirError,
)
from weir.shared.sampling import SamplingParams

MODEL = "tiny-llama"


def test_llm_generate_batches_prompts_in_order_and_matches_transformers(
    tiny_model_dir, tiny_hf_model
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["Hello there", [5, 6, 7, 8], "One fish, two fish, red fish, blue fish. " * 3]
    lengths = (3, 6, 9)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    with LLM(str(tiny_model_dir), max_num_batched_tokens=16, kv_cache_memory="1MiB") as llm:
        pids = [llm.server_info["pid"]] + [e["pid"] for e in llm.server_info["executors"]]
        completions = llm.generate(prompts, params)
        [single] = llm.generate("Hello there", params[0])
        [quiet] = llm.generate(
            prompts[2], SamplingParams(**{**params[2].to_dict(), "detokenize": False})
        )
        with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
            llm.generate(prompts, params[:2])
        # One bad prompt fails the call and aborts the others (they would run to the
        # context length, unread).
        endless = SamplingParams(max_tokens=None, ignore_eos=True)
        with pytest.raises(InvalidRequestError, match="empty"):
            llm.generate(["Hello"] * 4 + [""], endless)
        aborted = f'weir_requests_finished_total{{finished_reason="abort",model_name="{MODEL}"}}'
        deadline = time.monotonic() + 10
        while read_metrics(llm.server_info["metrics_address"]).get(aborted) != 4:
            assert time.monotonic() < deadline, "the other prompts' requests were not aborted"
            time.sleep(0.05)
        [chat] = llm.generate([{"role": "user", "content": "Hi"}], params[0])  # one prompt
        assert len(chat.token_ids) == 3
        # vLLM's prompt dicts, its logprobs and stop_reason.
        as_dicts = llm.generate(
            [{"prompt": prompts[0]}, {"prompt_token_ids": prompts[1]}], params[:2]
        )
        [one_dict] = llm.generate({"prompt_token_ids": prompts[1]}, params[1])
        with pytest.raises(ValueError, match="a prompt dict holds one of"):
            llm.generate({"prompt": "Hi", "mm_processor_kwargs": {}})
        with pytest.raises(ValueError, match="multi_modal_data holds"):
            llm.generate({"prompt": "Hi", "multi_modal_data": {"video": b"x"}})
        with pytest.raises(InvalidRequestError, match="this model takes no images"):
            llm.generate({"prompt": "<image>Hi", "multi_modal_data": {"image": b"\x89PNG"}})
        [scored] = llm.generate(
            prompts[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
        )
        stop_id = completions[1].token_ids[2]
        [stopped] = llm.generate(
            prompts[1], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_id])
        )
        # vLLM's forms in the other methods: prompt dicts for a beam search (one or a list),
        # OpenAI's chat messages (text parts, an assistant's null content); its ValueError.
        search = BeamSearchParams(beam_width=2, max_tokens=2)
        beams = llm.beam_search([prompts[1], prompts[0]], search, use_tqdm=False)
        as_dict_beams = llm.beam_search(
            [{"prompt_token_ids": prompts[1]}, {"prompt": prompts[0]}], search
        )
        [one_dict_beam] = llm.beam_search({"prompt_token_ids": prompts[1]}, search)
        chats = [
            [{"role": "user", "content": "Hi\nthere"}, {"role": "assistant", "content": ""}],
            [{"role": "user", "content": [{"type": "text", "text": t} for t in ("Hi", "there")]}]
            + [{"role": "assistant", "content": None}],
        ]
        plain, openai_shaped = llm.chat(
            chats, params[0], continue_final_message=True, add_generation_prompt=False
        )
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[10**6]], params[0])
        # vLLM's n: a prompt's samples in outputs, sample i seeded seed + i.
        sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
        [many] = llm.generate(prompts[2], replace(sampled, n=3), use_tqdm=False)
        alone = llm.generate([prompts[2]] * 3, [replace(sampled, seed=7 + i) for i in range(3)])
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    with pytest.raises(WeirError, match="LLM is closed"):
        llm.generate("Hi", params[0])

    assert [type(c) for c in completions] == [Completion] * 3
    for prompt, n, c in zip(prompts, lengths, completions):
        want_prompt = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        assert c.prompt_token_ids == want_prompt
        assert c.token_ids == hf_greedy(tiny_hf_model, want_prompt, n)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length" and c.request_id
    assert single.token_ids == completions[0].token_ids
    # vLLM's detokenize=False: the same tokens, no text.
    assert quiet.token_ids == completions[2].token_ids and completions[2].text and not quiet.text
    # The second time, the prompt's whole blocks were in the prefix cache (vLLM's count).
    assert completions[2].num_cached_tokens == 0 < quiet.num_cached_tokens
    assert quiet.num_cached_tokens < len(quiet.prompt_token_ids)
    assert [c.token_ids for c in as_dicts] == [c.token_ids for c in completions[:2]]
    assert one_dict.token_ids == completions[1].token_ids
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert completions[1].stop_reason is None and completions[1].logprobs is None
    assert [b.sequences for b in as_dict_beams] == [b.sequences for b in beams]
    assert one_dict_beam.sequences == beams[0].sequences
    assert openai_shaped.prompt_token_ids == plain.prompt_token_ids
    assert openai_shaped.token_ids == plain.token_ids
    assert [o.index for o in many.outputs] == [0, 1, 2] and many.outputs[0] is many
    assert [o.token_ids for o in many.outputs] == [c.token_ids for c in alone]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1
    assert [o.text for o in completions[0].outputs] == [completions[0].text]  # n=1
    with torch.no_grad():
        ids = prompts[1] + scored.token_ids
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([ids])).logits[0].double(), -1)
    assert scored.token_ids == completions[1].token_ids[:3] and len(scored.logprobs) == 3
    for i, (token, row) in enumerate(zip(scored.token_ids, scored.logprobs)):
        want = ref[len(prompts[1]) - 1 + i]
        top = want.topk(2).indices.tolist()
        assert set(row) == {token, *top}
        assert [row[t] for t in (token, *top)] == pytest.approx(
            [want[t].item() for t in (token, *top)], abs=1e-4
        )
    # vLLM's cumulative_logprob: the sum of the output tokens' logprobs (with logprobs only).
    want = sum(ref[len(prompts[1]) - 1 + i, t].item() for i, t in enumerate(scored.token_ids))
    assert scored.cumulative_logprob == pytest.approx(want, abs=1e-4)
    assert completions[1].cumulative_logprob is None


def test_llm_cuts_max_tokens_at_the_context_and_takes_one_priority_for_every_prompt(
    tiny_model_dir,
):
    """vLLM's offline LLM: a max_tokens past max_model_len ends the output there ("length",
    the tokens of the max_tokens that fits) instead of failing the batch; the SDK refuses it
    (as the HTTP API) unless asked to cap. One priority number is every prompt's (vLLM's)."""
    max_model_len = 48
    prompts = ["Hello there", list(range(5, 25))]
    beyond = SamplingParams(max_tokens=max_model_len + 10, temperature=0.0, ignore_eos=True)
    with LLM(
        str(tiny_model_dir),
        max_model_len=max_model_len,
        policy="priority",
        kv_cache_memory="1MiB",
    ) as llm:
        capped = llm.generate(prompts, beyond, priority=1, use_tqdm=False)
        chat = [{"role": "user", "content": "Hi"}]
        [capped_chat] = llm.chat(chat, beyond, priority=-1, use_tqdm=False)
        rooms = [max_model_len - len(c.prompt_token_ids) for c in capped]
        fitting = llm.generate(
            prompts, [replace(beyond, max_tokens=room) for room in rooms], use_tqdm=False
        )
        with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
            llm.generate(prompts, beyond, priority=[1], use_tqdm=False)
        for wrong in ("x", 1.5):
            with pytest.raises(TypeError, match="priority must be an int or a list of ints"):
                llm.generate(prompts, beyond, priority=wrong, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="min_tokens is too large"):
            llm.generate(
                prompts[0], replace(beyond, min_tokens=max_model_len), priority=1, use_tqdm=False
            )
        with WeirClient(llm.server_info["client_address"]) as client:
            with pytest.raises(InvalidRequestError, match="max_tokens is too large"):
                list(client.generate(prompts[0], beyond))
            sdk = client.generate(prompts[0], beyond, cap_max_tokens=True)
            sdk_tokens = [t for out in sdk for t in out.new_token_ids]
    assert len(capped_chat.prompt_token_ids) < max_model_len
    for c in (*capped, capped_chat):
        assert len(c.prompt_token_ids) + len(c.token_ids) == max_model_len
        assert c.finish_reason == "length" and c.finished
    assert [c.token_ids for c in capped] == [c.token_ids for c in fitting]
    assert sdk_tokens == capped[0].token_ids
    # vLLM's RequestOutput.prompt: the text as given, None for token ids.
    assert [c.prompt for c in capped] == ["Hello there", None] and capped_chat.prompt is None


def test_pooling_outputs_read_as_vllms_too():
    """vLLM's pooling outputs hold their result in ``outputs``: ``out.outputs.embedding``."""
    data = np.array([0.5, -1.0], dtype="<f4").tobytes()
    embedding = EmbeddingOutput("e", data, [1, 2])
    classification = ClassificationOutput("c", data, [1, 2])
    score = ScoreOutput("s", 0.25, [1, 2])
    assert embedding.outputs.embedding == embedding.embedding == [0.5, -1.0]
    assert classification.outputs.probs == classification.probs == [0.5, -1.0]
    assert score.outputs.score == score.score == 0.25


def _refused_in_a_fork(llm: LLM, params: SamplingParams) -> None:
    with pytest.raises(WeirError, match=f"LLM was created in process {os.getppid()}"):
        llm.generate("Hi", params, use_tqdm=False)
    llm.close()  # what its finalizer does at exit


def test_an_llm_dropped_without_close_stops_its_processes(tiny_model_dir):
    """...also in a cycle the GC collects on the LLM's own loop thread (its finalizer waited
    there for itself, and the processes ran on). A fork's child cannot use it, and its exit
    neither hangs (waiting on a loop with no thread there) nor stops the parent's processes."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory="1MiB")
    pids = [llm.server_info["pid"]] + [e["pid"] for e in llm.server_info["executors"]]
    params = SamplingParams(max_tokens=2)
    child = functools.partial(_refused_in_a_fork, llm, params)  # no closure: llm is deleted
    assert exit_code_of_a_fork(child) == 0, "the child hung or failed"
    del child
    assert llm.generate("Hi", params, use_tqdm=False)[0].finish_reason
    loop = llm._loop
    llm.me = llm  # a cycle
    gc.disable()  # until the loop thread collects it
    try:
        del llm
        loop.loop.call_soon_threadsafe(gc.collect)
        deadline = time.monotonic() + 10
        while [pid for pid in pids if Path(f"/proc/{pid}").exists()]:
            assert time.monotonic() < deadline, "the dropped LLM's processes still run"
            time.sleep(0.05)
    finally:
        gc.enable()


def test_llm_chat_renders_as_transformers_and_generates_its_greedy_tokens(
    tiny_model_dir, tiny_hf_model
):
    """vLLM's LLM.chat: one conversation or several, the template's arguments as
    transformers' apply_chat_template takes them (continue_final_message included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ask = [{"role": "user", "content": "Name a colour."}]
    started = [*ask, {"role": "assistant", "content": "The colour is"}]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def hf_ids(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)

    with LLM(str(tiny_model_dir), kv_cache_memory="1MiB") as llm:
        [one] = llm.chat(ask, params)
        two = llm.chat([ask, started], params)
        [going_on] = llm.chat(
            started, params, add_generation_prompt=False, continue_final_message=True
        )
        with pytest.raises(InvalidRequestError, match="add_generation_prompt false"):
            llm.chat(started, params, continue_final_message=True)
        own = llm.get_tokenizer()  # vLLM's: the model's transformers tokenizer
    want = hf_ids(ask, add_generation_prompt=True)
    assert type(own) is type(tokenizer)
    assert own.apply_chat_template(ask, add_generation_prompt=True, return_dict=False) == want
    assert one.prompt_token_ids == two[0].prompt_token_ids == want
    assert one.token_ids == hf_greedy(tiny_hf_model, want, 3)
    assert two[1].prompt_token_ids == hf_ids(started, add_generation_prompt=True)
    want = hf_ids(started, continue_final_message=True)
    assert going_on.prompt_token_ids == want
    assert tokenizer.decode(want).endswith("The colour is")
    assert going_on.token_ids == hf_greedy(tiny_hf_model, want, 3)


def test_hf_overrides_replace_config_keys_for_every_process(tiny_model_dir, tmp_path):
    """vLLM's hf_overrides: the scheduler (context length) and the executor (rotation) both
    read config.json with the keys replaced; the tokens are transformers' on a config.json
    edited alike, not the unchanged model's."""
    import json
    import shutil

    import torch
    import transformers

    overrides = {
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50.0},
        "max_position_embeddings": 256,
    }
    edited = tmp_path / "edited"
    shutil.copytree(tiny_model_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, **overrides}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(edited, dtype=torch.float32).eval()
    prompt = list(range(5, 45))
    want = hf_greedy(hf, prompt, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), hf_overrides=overrides, kv_cache_memory="4MiB") as llm:
        [got] = llm.generate([prompt], params)
        # The scheduler's context: 256 x the linear factor (vLLM's), not the model's 512.
        with pytest.raises(InvalidRequestError, match="max_model_len is 1024"):
            llm.generate([[5] * 1100], params)
    assert got.token_ids == want
    with LLM(str(tiny_model_dir), kv_cache_memory="4MiB") as llm:
        [plain] = llm.generate([prompt], params)
    assert plain.token_ids != want, "the overrides must matter"
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(str(tiny_model_dir), hf_overrides="[1]")


def test_an_llm_whose_scheduler_died_fails_its_calls_at_once(tiny_model_dir):
    """A call after the scheduler died (which would wait the client's 60 s for an answer)
    fails at once, naming the process that exited."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir)) as llm:
        llm.generate("Hi", params)
        os.kill(llm.server_info["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm._server.exited is None:
            assert time.monotonic() < deadline, "the launcher did not see the scheduler exit"
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(WeirError, match=r"the LLM's scheduler exited \(code -9\)"):
            llm.generate("Hi", params)
        assert time.monotonic() - started < 1
