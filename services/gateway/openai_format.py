"""Weir's streamed outputs in OpenAI's response shapes (completions and chat, whole and
streamed), and OpenAI's error body."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from weir.shared.protocol.client import StreamOutput


def error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _rows(out: StreamOutput) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(sampled token, its logprob, top alternatives) per new token."""
    lp = out.logprobs or {}
    rows = []
    for tokens, logprobs in zip(lp.get("tokens", []), lp.get("logprobs", [])):
        rows.append((tokens[0], logprobs[0], list(zip(tokens[1:], logprobs[1:]))))
    return rows


def completion_logprobs(out: StreamOutput, text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for one output's tokens."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, logprob, alternatives in _rows(out):
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        token_logprobs.append(logprob)
        top.append(dict(alternatives))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(out: StreamOutput) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content``: one entry per token) for one output."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in alternatives]}
            for token, logprob, alternatives in _rows(out)
        ]
    }


@dataclass(slots=True)
class Choice:
    """One choice of a response, accumulated from its stream."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[StreamOutput] = field(default_factory=list)

    def add(self, out: StreamOutput) -> None:
        self.text += out.text
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
        if out.logprobs is not None:
            self.logprobs.append(out)

    def merged_logprobs(self) -> StreamOutput:
        merged: dict[str, list[list[Any]]] = {"tokens": [], "logprobs": []}
        for out in self.logprobs:
            merged["tokens"] += (out.logprobs or {}).get("tokens", [])
            merged["logprobs"] += (out.logprobs or {}).get("logprobs", [])
        return StreamOutput(request_id="", new_token_ids=[], text="", logprobs=merged)
