"""Weir's streamed outputs in OpenAI's response shapes (completions and chat, whole and
streamed), and OpenAI's error body."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from weir.shared.protocol.client import StreamOutput


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _json(value: Any) -> str:
    """``json.dumps(value)`` as the events carry it; a string or None without a dumps call."""
    if value is None:
        return "null"
    if type(value) is str:
        return encode_basestring_ascii(value)
    return json.dumps(value, separators=(",", ":"))


class ChunkEvents:
    """The server-sent events of one streamed response's chunks: each is exactly
    ``sse({**base, "choices": [choice]})``, but the text up to the choice is made once per
    response, so a token costs a few string escapes instead of building and dumping a
    nested dict (the largest part of the gateway's CPU per token after the socket write)."""

    __slots__ = ("_base", "_head", "_chat_logprobs", "token_ids", "_usage")

    def __init__(
        self,
        base: dict[str, Any],
        chat_logprobs: bool = False,
        token_ids: bool = False,
        usage: bool = False,
    ) -> None:
        self._base = "data: " + _json(base)[:-1]
        self._head = self._base + ',"choices":[{"index":'
        self._chat_logprobs = chat_logprobs
        # vLLM's return_token_ids: each chunk's token ids, and the prompt's with the first
        # (a chat's with its role's chunk).
        self.token_ids = token_ids
        # vLLM's continuous_usage_stats: each chunk's choice's usage so far.
        self._usage = usage

    def _end(self, out: StreamOutput) -> str:
        """What closes a chunk of ``out``: its choices list, and its usage where asked for."""
        if not self._usage:
            return "}]}\n\n"
        return f'}}],"usage":{_json(usage(out.prompt_tokens, out.completion_tokens))}}}\n\n'

    def _ids(self, out: StreamOutput, prompt_key: str) -> str:
        """The token-id fields of ``out``'s chunk, after ``prompt_key``'s prefix."""
        ids = f',"token_ids":{_json(out.new_token_ids)}'
        if out.prompt_token_ids is not None and prompt_key:
            ids += f',"{prompt_key}":{_json(out.prompt_token_ids)}'
        return ids

    def completion(self, out: StreamOutput, choice: Choice) -> str:
        """A ``text_completion`` chunk (``choice`` has already added ``out``)."""
        logprobs = (
            "null" if out.logprobs is None else _json(completion_logprobs(out, choice.text_offset))
        )
        ids = self._ids(out, "prompt_token_ids") if self.token_ids else ""
        return (
            f'{self._head}{choice.index},"text":{_json(out.text)},'
            f'"finish_reason":{_json(out.finish_reason if out.finished else None)},'
            f'"stop_reason":{_json(out.stop_reason)},"logprobs":{logprobs}{ids}{self._end(out)}'
        )

    def chat(self, out: StreamOutput, choice: Choice) -> str:
        """A ``chat.completion.chunk``: the delta is empty in a last chunk without text."""
        delta = '{"content":' + _json(out.text) + "}" if out.text or not out.finished else "{}"
        return self._chat(choice.index, delta, out, out.finish_reason if out.finished else None)

    def chat_delta(
        self, index: int, delta: dict[str, Any], out: StreamOutput, finish_reason: str | None
    ) -> str:
        """A ``chat.completion.chunk`` of any delta (tool calls), for ``out``."""
        return self._chat(index, _json(delta), out, finish_reason)

    def _chat(self, index: int, delta: str, out: StreamOutput, finish_reason: str | None) -> str:
        logprobs = _json(chat_logprobs(out)) if self._chat_logprobs else "null"
        ids = self._ids(out, "") if self.token_ids else ""  # the prompt's went with the role
        return (
            f'{self._head}{index},"delta":{delta},"logprobs":{logprobs},'
            f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(out.stop_reason)}'
            f"{ids}{self._end(out)}"
        )


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; with ``cached_tokens``, its ``prompt_tokens_details`` too (the
    prompt's tokens found in the prefix cache)."""
    fields: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        fields["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return fields


def _rows(out: StreamOutput) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """(sampled token, its logprob, top alternatives) per new token."""
    lp = out.logprobs or {}
    rows = []
    for tokens, logprobs in zip(lp.get("tokens", []), lp.get("logprobs", [])):
        rows.append((tokens[0], logprobs[0], list(zip(tokens[1:], logprobs[1:]))))
    return rows


def completion_logprobs(out: StreamOutput, text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for one output's tokens, the first at
    ``text_offset``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, logprob, alternatives in _rows(out):
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        token_logprobs.append(logprob)
        # The sampled token first, then the n most likely (up to n + 1 entries), as OpenAI
        # and vLLM give it; null for an echoed prompt's first token, which nothing predicts.
        # An alternative of the same text (another part of a character has none) keeps
        # the first entry's logprob: the sampled token's is its own.
        entries: dict[str, float] | None = None
        if logprob is not None:
            entries = {token: logprob}
            for alternative, alternative_logprob in alternatives:
                entries.setdefault(alternative, alternative_logprob)
        top.append(entries)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(out: StreamOutput) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content``: one entry per token) for one output.
    A token's ``bytes`` are its own, a part of a character's too (the scheduler's rows of
    a chat carry them), so that laid end to end they are the text's UTF-8, as OpenAI's."""
    lp = out.logprobs or {}
    tokens, logprobs = lp.get("tokens", []), lp.get("logprobs", [])
    raw = lp.get("bytes") or [[token.encode() for token in row] for row in tokens]

    def entry(i: int, j: int) -> dict[str, Any]:
        return {"token": tokens[i][j], "logprob": logprobs[i][j], "bytes": list(raw[i][j])}

    return {
        "content": [
            {**entry(i, 0), "top_logprobs": [entry(i, j) for j in range(1, len(row))]}
            for i, row in enumerate(tokens)
        ]
    }


@dataclass(slots=True)
class Choice:
    """One choice of a response, accumulated from its stream."""

    index: int
    # The text in pieces, joined when asked for: one concatenation per token would copy
    # the whole text each time.
    pieces: list[str] = field(default_factory=list)
    length: int = 0  # characters of text so far
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    # Of the prompt's, found in the prefix cache; None where not told (a beam search's).
    num_cached_tokens: int | None = None
    completion_tokens: int = 0
    logprobs: list[StreamOutput] = field(default_factory=list)
    # Characters of the logprob tokens before the last output's: its first token's
    # text_offset, counted as the whole response's (the text sent so far may be shorter,
    # held back while it could begin a stop string).
    text_offset: int = 0
    token_chars: int = 0  # characters of the logprob tokens so far
    token_ids: list[int] | None = None  # kept when asked for (return_token_ids)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: dict[str, list[list[Any]]] | None = None  # the first output's rows

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, out: StreamOutput) -> None:
        self.pieces.append(out.text)
        self.length += len(out.text)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        if self.token_ids is not None:
            self.token_ids += out.new_token_ids
            if out.prompt_token_ids is not None:
                self.prompt_token_ids = out.prompt_token_ids
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if out.logprobs is not None:
            self.logprobs.append(out)
            self.text_offset = self.token_chars
            self.token_chars += sum(len(row[0]) for row in out.logprobs.get("tokens", ()))
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs

    def vllm_prompt_logprobs(self) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, null for the first (nothing predicts
        it), else ``{token id: {logprob, rank, decoded_token}}``, the prompt token's first
        (its rank in its distribution), then the likeliest others (ranked by place)."""
        rows = self.prompt_logprobs or {}
        result: list[dict[str, Any] | None] = []
        for ids, logprobs, tokens, [rank] in zip(
            rows["token_ids"], rows["logprobs"], rows["tokens"], rows["ranks"], strict=True
        ):
            if rank is None:
                result.append(None)
                continue
            entry = {
                str(ids[0]): {"logprob": logprobs[0], "rank": rank, "decoded_token": tokens[0]}
            }
            for place, (token_id, logprob, token) in enumerate(
                zip(ids[1:], logprobs[1:], tokens[1:], strict=True), 1
            ):
                entry.setdefault(
                    str(token_id), {"logprob": logprob, "rank": place, "decoded_token": token}
                )
            result.append(entry)
        return result

    def merged_logprobs(self) -> StreamOutput:
        merged: dict[str, list[list[Any]]] = {}
        for out in self.logprobs:
            for key, rows in (out.logprobs or {}).items():
                merged.setdefault(key, []).extend(rows)
        return StreamOutput(request_id="", new_token_ids=[], text="", logprobs=merged)
