"""Helpers for the process-level tests (reference decoding, metrics scraping)."""

import urllib.request

import torch


def hf_greedy(
    model,
    prompt_ids: list[int],
    num_tokens: int,
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    logit_bias: dict[int, float] | None = None,
) -> list[int]:
    """Reference greedy decoding: full forward pass per token, argmax, no EOS stop. With
    penalties as OpenAI and vLLM define them, token by token: the bias added, a token seen in
    the prompt or output divided by ``repetition`` (multiplied when its logit is not
    positive), then ``presence`` once and ``frequency`` per occurrence in the output
    subtracted."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            for token, bias in (logit_bias or {}).items():
                logits[token] += bias
            for token in set(ids) if repetition != 1 else ():
                x = logits[token]
                logits[token] = x / repetition if x > 0 else x * repetition
            outputs = ids[len(prompt_ids) :]
            for token in set(outputs):
                logits[token] -= presence + frequency * outputs.count(token)
            ids.append(max(range(len(logits)), key=logits.__getitem__))
    return ids[len(prompt_ids) :]


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
