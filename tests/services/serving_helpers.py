"""Helpers for the process-level tests (reference decoding, metrics scraping)."""

import contextlib
import os
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
import zmq

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.gateway.chat_output import NO_PARSERS, ChatParsers
from weir.services.launcher import ServerProcesses
from weir.services.llm import LLM
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import EXECUTOR, CacheConfig, EngineArgs, SchedulerConfig
from weir.shared.sampling import SamplingParams


def small_server(
    model_dir, name: str, parsers: ChatParsers = NO_PARSERS, **engine
) -> ServerProcesses:
    """`weir serve` on a small model with the HTTP gateway, every port free, a context of
    512 tokens in blocks of 16 (``engine`` overrides any engine option)."""
    options = {
        "model": str(model_dir),
        "max_num_batched_tokens": 64,
        "block_size": 16,
        "max_model_len": 512,
        "device": "cpu",
        "served_model_name": name,
        **engine,
    }
    return ServerProcesses(
        EngineArgs(**options),
        port=0,
        metrics_port=0,
        executor_metrics_port=0,
        http_port=0,
        parsers=parsers,
    )


def stop_the_replacement(server: ServerProcesses, lost_pid: int, timeout: float = 60.0) -> int:
    """SIGSTOP the executor `weir serve` starts in place of ``lost_pid`` (which its scheduler
    gave up on) before it can join, so the replica stays recovering; its pid."""
    deadline = time.monotonic() + timeout
    while True:
        new = [
            c.proc.pid
            for c in server._children
            if c.role == EXECUTOR and c.proc.pid != lost_pid and c.proc.poll() is None
        ]
        if new:
            os.kill(new[0], signal.SIGSTOP)
            return new[0]
        assert time.monotonic() < deadline, f"executor {lost_pid} was never replaced"
        time.sleep(0.01)


@contextlib.contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket]:
    """A bare ZeroMQ DEALER: what a client that ignores the SDK sends from."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def hf_greedy(
    model,
    prompt_ids: list[int],
    num_tokens: int,
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    bad_words: Sequence[Sequence[int]] = (),
) -> list[int]:
    """Reference greedy decoding: full forward pass per token, argmax, no EOS stop. With
    penalties as OpenAI and vLLM define them, token by token: the bias added, a token seen in
    the prompt or output divided by ``repetition`` (multiplied when its logit is not
    positive), then ``presence`` once and ``frequency`` per occurrence in the output
    subtracted. ``bad_words`` (token sequences, as vLLM's): a sequence's last token is never
    picked right after the output's last tokens are the rest of it."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            # The last position's logits only (the LM head over every position made a long
            # reference quadratic), in float64 as Python's floats were.
            logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].double()
            outputs = ids[len(prompt_ids) :]
            for *before, last in bad_words:
                if len(before) <= len(outputs) and outputs[len(outputs) - len(before) :] == before:
                    logits[last] = float("-inf")
            for token, bias in (logit_bias or {}).items():
                logits[token] += bias
            if repetition != 1:
                seen = torch.tensor(sorted(set(ids)))
                x = logits[seen]
                logits[seen] = torch.where(x > 0, x / repetition, x * repetition)
            if outputs:
                counts = Counter(outputs)
                occurrences = torch.tensor(list(counts.values()), dtype=torch.float64)
                logits[torch.tensor(list(counts))] -= presence + frequency * occurrences
            ids.append(int(logits.argmax()))  # the first of equal maxima, as max() took
    return ids[len(prompt_ids) :]


# The penalties the tests hold to transformers (the tiny model's random weights never repeat
# a token: biases towards four make it, so the penalties have repeats to act on).
TINY_BIAS = dict.fromkeys(range(7, 11), 5.0)
PENALTIES = {"presence": 0.5, "frequency": 0.7, "repetition": 1.3, "logit_bias": TINY_BIAS}


def penalized(max_tokens: int) -> SamplingParams:
    """Greedy ``SamplingParams`` with ``PENALTIES``, EOS ignored."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=PENALTIES["presence"],
        frequency_penalty=PENALTIES["frequency"],
        repetition_penalty=PENALTIES["repetition"],
        logit_bias=TINY_BIAS,
    )


def hf_constrained(model, prompt_ids: list[int], num_tokens: int, compiled, eos: int) -> list[int]:
    """transformers' greedy decoding held to a grammar by xgrammar's own logits processor
    (``compiled``: an ``xgrammar.CompiledGrammar``), ending on ``eos`` once complete."""
    from xgrammar.contrib.hf import LogitsProcessor

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
            logits_processor=[LogitsProcessor(compiled)],
        )
    return out[0, len(prompt_ids) :].tolist()


def generate_in_core(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Each prompt's output tokens, the engine core stepped until every request ends (request
    ids ``r0``, ``r1``...); with logprobs, one row per token checked (drafts' included)."""
    for i, prompt in enumerate(prompts):
        core.scheduler.add_request(Request(f"r{i}", prompt, params))
    produced: list[list[int]] = [[] for _ in prompts]
    while core.has_work():
        step = step_now(core)
        for out in step.outputs if step else ():
            produced[int(out.request_id[1:])] += out.new_token_ids
            if params.logprobs is not None:
                assert out.logprobs is not None
                assert [row[0] for row in out.logprobs.token_ids] == out.new_token_ids
    step_now(core)  # tells the executor which requests finished
    return produced


def greedy_completion(client, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The token ids of a greedy completion through the official openai client, EOS ignored."""
    reply = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return reply.choices[0].token_ids


def read_metrics(url: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value} (comments skipped)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of ``name`` (over its label sets)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def wait_for_metric(url: str, name: str, at_least: float, timeout: float = 10.0) -> float:
    """``name``'s value once it reaches ``at_least``: the scheduler refreshes its counters
    after the step whose output a reply carries, so a scrape right after may be early."""
    deadline = time.monotonic() + timeout
    while (value := metric(read_metrics(url), name)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value}, below {at_least}"
        time.sleep(0.05)
    return value


def frontend_over(sock, tokenizer, scheduler, name: str):
    """A real ``ClientFrontend`` on ``sock`` whose engine core runs ``scheduler`` with no
    executor: a test publishes the steps itself."""
    from types import SimpleNamespace

    from weir.services.engine.core import EngineCore, InProcessExecutor
    from weir.services.engine.frontend import ClientFrontend
    from weir.services.engine.metrics import SchedulerMetrics

    frontend = ClientFrontend(
        sock,
        tokenizer,
        tokenizer.vocab_size,
        scheduler.scheduler_config.max_model_len,
        SchedulerMetrics(name),
        wake=lambda: None,
        requests_ended=lambda: None,
        health=lambda stream_ids: {},
        model_info=lambda: {},
    )
    frontend.core = EngineCore(scheduler, InProcessExecutor(SimpleNamespace()))
    return frontend


def published_step(step_id: int, outputs: list, admitted: Sequence[str] = ()):
    """A step as the engine core returns it, for a test that publishes steps itself: its
    id, the requests it admitted (a stream takes outputs from its admission on) and its
    outputs."""
    from types import SimpleNamespace

    from weir.services.engine.core import EngineStep

    new_requests = [SimpleNamespace(request_id=rid) for rid in admitted]
    return EngineStep(
        SimpleNamespace(step_id=step_id, new_requests=new_requests), outputs, time.monotonic()
    )


def read_chat(client, stream: bool, **kwargs) -> tuple:
    """A chat's (reasoning, content, tool calls as (name, arguments), finish reason), whole
    or from its stream, through the openai client (``kwargs`` its create's); a stream's
    reasoning deltas come as reasoning and as reasoning_content, alike."""
    create = client.chat.completions.create
    if not stream:
        [choice] = create(**kwargs).choices
        message = choice.message.model_dump()
        assert message.get("reasoning") == message.get("reasoning_content")
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or ()
        ]
        return message.get("reasoning"), message["content"], calls, choice.finish_reason
    reasoning, content, calls, finish = None, None, [], None
    for chunk in create(stream=True, **kwargs):
        [choice] = chunk.choices
        delta = choice.delta.model_dump()
        assert delta.get("reasoning") == delta.get("reasoning_content")
        if delta.get("reasoning"):
            reasoning = (reasoning or "") + delta["reasoning"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        calls += [
            (c["function"]["name"], c["function"]["arguments"])
            for c in delta.get("tool_calls") or ()
        ]
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def exit_code_of_a_fork(child: Callable[[], object]) -> int:
    """Run ``child`` in a forked child, which never returns into pytest: it exits 0 once
    ``child`` returns, 1 if it raises, and dies of an alarm if it hangs 10 s."""
    pid = os.fork()
    if pid == 0:
        done = False
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(10)
            child()
            done = True
        finally:
            os._exit(0 if done else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def drafting_core(runner, k: int, max_num_batched_tokens: int) -> EngineCore:
    """An engine core over ``runner`` (an in-process ``ModelRunner`` whose drafts the
    executor proposes: a draft model's or an EAGLE head's), ``k`` drafts a step, four
    requests at a time."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=4,
            num_speculative_tokens=k,
            num_lookahead_tokens=k,
        ),
        CacheConfig(num_blocks=runner.num_blocks),
    )
    return EngineCore(scheduler, InProcessExecutor(runner))


def check_llm_drafts(model_dir, hf_model, speculative_config: dict) -> None:
    """vLLM's ``speculative_config`` through ``LLM``'s processes: greedy outputs are
    transformers' (drafts never change them), and the draft proposed some."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(100, 130))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        str(model_dir),
        device="cpu",
        max_num_batched_tokens=16,
        speculative_config=speculative_config,
    ) as llm:
        completions = llm.generate(prompts, greedy)
        samples = read_metrics(llm.server_info["metrics_address"])
    assert metric(samples, "weir_spec_decode_draft_tokens_total") > 0
    for prompt, completion in zip(prompts, completions):
        assert completion.token_ids == hf_greedy(hf_model, prompt, greedy.max_tokens)
