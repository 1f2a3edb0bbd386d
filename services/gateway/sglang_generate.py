"""SGLang's native ``POST /generate``, what its clients and the RL frameworks that roll out
with SGLang (verl, slime, AReaL) send: ``text`` or ``input_ids`` (one prompt or a batch),
``sampling_params`` in SGLang's names, ``return_logprob`` with ``top_logprobs_num`` and
``logprob_start_len``, ``stream``, ``rid``, ``lora_path``. Each is translated into the
completion it is (``completion_body``), so it is checked and sampled as a completion is;
each result is SGLang's ``{"text", "output_ids", "meta_info"}``, a list for a batch, and
a stream sends each result's text and ids so far, then ``[DONE]``, as SGLang does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from weir.services.gateway.openai_format import Choice
from weir.services.gateway.schemas import Body, CompletionRequest

# SGLang's names of the completion fields they become, for errors that name the latter.
FIELD_NAMES = (
    ("max_tokens", "max_new_tokens"),
    ("min_tokens", "min_new_tokens"),
    ("include_stop_str_in_output", "no_stop_trim"),
    ("seed", "sampling_seed"),
    ("logprobs", "top_logprobs_num"),
    ("prompt_logprobs", "top_logprobs_num"),
    ("prompt", "input_ids"),
)


class SglangSamplingParams(Body):
    """SGLang's ``sampling_params`` (its defaults: 128 new tokens, temperature 1)."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # the stop string stays in the text
    n: Annotated[int, Field(ge=1)] = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None

    def completion_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "max_tokens": self.max_new_tokens,
            "min_tokens": self.min_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.no_stop_trim,
            "n": self.n,
            "seed": self.sampling_seed,
            "logit_bias": self.logit_bias,
        }
        formats = {
            kind: value
            for kind, value in (
                ("json", self.json_schema),
                ("regex", self.regex),
                ("grammar", self.ebnf),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        }
        if formats:
            fields["structured_outputs"] = formats
        return fields


class NativeGenerateRequest(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # from which prompt token its logprobs come back; -1: none
    top_logprobs_num: Annotated[int, Field(ge=0)] = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    lora_path: str | None = None  # the served LoRA adapter's name

    def prompts(self) -> list[str | list[int]]:
        """Its prompts; ValueError unless exactly one of text and input_ids holds them."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give text or input_ids, one of them")
        if self.text is not None:
            return [self.text] if isinstance(self.text, str) else list(self.text)
        ids: list[Any] = self.input_ids or []
        if ids and isinstance(ids[0], list):
            return [list(prompt) for prompt in ids]
        return [ids]

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or bool(
            self.input_ids and isinstance(self.input_ids[0], list)
        )

    def completion_body(self, index: int, prompt: str | list[int]) -> CompletionRequest:
        """Prompt ``index``'s completion (``sampling_params`` may be one per prompt);
        ValueError (pydantic's) names what is wrong in the completion's names."""
        params = self.sampling_params
        if isinstance(params, list):
            params = params[index]
        fields = (params or SglangSamplingParams()).completion_fields()
        if self.return_logprob:
            fields["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                fields["prompt_logprobs"] = self.top_logprobs_num
        return CompletionRequest.model_validate(
            {**fields, "prompt": prompt, "stream": self.stream, "return_token_ids": True}
        )

    def rid_of(self, index: int) -> str | None:
        return self.rid[index] if isinstance(self.rid, list) else self.rid


class SglangPauseBody(Body):
    """``/pause_generation``'s: ``in_place`` (SGLang's default) keeps the requests where
    they are, ``retract`` keeps them waiting, ``abort`` ends them."""

    mode: Literal["in_place", "retract", "abort"] = "in_place"


class SglangAbortBody(Body):
    """``/abort_request``'s: the ``rid`` of the requests to end, or ``abort_all``."""

    rid: str = ""
    abort_all: bool = False


class SglangMemoryBody(Body):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``'s: which of the
    weights and the KV cache (all by default)."""

    tags: list[Literal["weights", "kv_cache"]] | None = None


def result(
    choice: Choice,
    token_ids: list[int],
    rid: str,
    e2e_latency: float,
    request: NativeGenerateRequest,
) -> dict[str, Any]:
    """One prompt's (or one of its n samples') result so far, as SGLang writes it."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(choice, token_ids),
        "prompt_tokens": choice.prompt_tokens,
        "completion_tokens": choice.completion_tokens,
        "cached_tokens": choice.num_cached_tokens or 0,
        "e2e_latency": e2e_latency,
    }
    if request.return_logprob:
        with_text = request.return_text_in_logprobs
        rows = choice.merged_logprobs().logprobs or {}
        sampled, top = _logprob_rows(rows, with_text)
        meta["output_token_logprobs"] = sampled
        meta["output_top_logprobs"] = top
        if request.logprob_start_len >= 0 and choice.prompt_logprobs is not None:
            start = request.logprob_start_len
            sampled, top = _logprob_rows(choice.prompt_logprobs, with_text)
            meta["input_token_logprobs"] = sampled[start:]
            meta["input_top_logprobs"] = top[start:]
    return {"text": choice.text, "output_ids": token_ids, "meta_info": meta}


def _finish_reason(choice: Choice, token_ids: list[int]) -> dict[str, Any] | None:
    reason = choice.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": choice.completion_tokens}
    if reason == "stop":
        # SGLang names what matched: the stop string, or the token (an end token too).
        matched = choice.stop_reason
        if matched is None and token_ids:
            matched = token_ids[-1]
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": reason}


def _logprob_rows(
    rows: dict[str, list[list[Any]]], with_text: bool
) -> tuple[list[list[Any]], list[list[list[Any]]]]:
    """SGLang's ``(logprob, token_id, text)`` of each position's token, and of its top
    alternatives (the text None unless asked for)."""
    sampled, top = [], []
    for ids, logprobs, texts in zip(rows["token_ids"], rows["logprobs"], rows["tokens"]):
        sampled.append([logprobs[0], ids[0], texts[0] if with_text else None])
        top.append(
            [
                [lp, token, text if with_text else None]
                for lp, token, text in zip(logprobs[1:], ids[1:], texts[1:])
            ]
        )
    return sampled, top
