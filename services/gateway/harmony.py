"""gpt-oss' harmony format read out of its text, as vLLM's ``--reasoning-parser openai_gptoss``
and ``--tool-call-parser openai`` read it.

A harmony output is a run of messages. Each opens with a header up to ``<|message|>`` (the
first one's ``<|start|>assistant`` is the prompt's end; later ones write it) naming the
message's channel (``<|channel|>analysis``) and, for a call, its recipient (``to=functions.NAME``,
in the header before or after the channel), and ends on ``<|end|>``, or on ``<|call|>`` or
``<|return|>`` (stop tokens: out of the text, so the output's end ends a message too). The ``analysis`` channel is the
reasoning; ``final``, and ``commentary`` addressed to no one (a preamble), the content; a
message to ``functions.NAME`` is a call of that function, its body the arguments (when the
request's calls are read; else content). The markers are special tokens: a request read so
is detokenized with them (``skip_special_tokens`` false). An output that does not open with
a header (held to a format from its first token) is all content.
"""

from __future__ import annotations

import re
from typing import Any

from weir.services.gateway.json_calls import ToolCall, tag_prefix_at_end

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
# How an output's first header may begin, its <|start|>assistant being the prompt's end.
_OPENINGS = (CHANNEL, START, MESSAGE, " to=", "to=")
# A body ends at its end marker, or where another message's header begins without one.
_BOUNDARIES = (*ENDS, START, CHANNEL)
FUNCTIONS = "functions."
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


class HarmonyReader:
    """One choice's harmony text as it streams: per piece, the reasoning and content it
    completes and the calls it closes (each whole in one delta). Fed piece by piece it reads
    what it reads in the whole text. ``calls`` is None where the request's calls are not
    read (no tools, or ``tool_choice`` none)."""

    def __init__(self, read_calls: bool) -> None:
        self.calls: list[ToolCall] | None = [] if read_calls else None
        self.reasoned = False  # whether the text held an analysis message (maybe empty)
        self._pending = ""
        self._state = "open"  # then "header", "body", "between"; "plain" without headers
        self._channel = ""
        self._call: str | None = None  # the function the message in "body" calls
        self._arguments: list[str] = []

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._pending:
            if self._state == "open":
                if self._pending.startswith(_OPENINGS):
                    self._state = "header"
                elif any(opening.startswith(self._pending) for opening in _OPENINGS):
                    break
                else:
                    self._state = "plain"
            elif self._state == "plain":
                content.append(self._pending)
                self._pending = ""
            elif self._state == "between":
                if self._pending.startswith(START):
                    self._pending = self._pending[len(START) :]
                    self._state = "header"
                elif START.startswith(self._pending):
                    break
                else:  # a header without its <|start|>
                    self._state = "header"
            elif self._state == "header":
                at = self._pending.find(MESSAGE)
                if at < 0:
                    break
                self._open(self._pending[:at])
                self._pending = self._pending[at + len(MESSAGE) :]
            else:  # body
                found = [(i, m) for m in _BOUNDARIES if (i := self._pending.find(m)) >= 0]
                if not found:
                    keep = max(tag_prefix_at_end(self._pending, m) for m in _BOUNDARIES)
                    body = self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    self._route(body, reasoning, content)
                    break
                at, boundary = min(found)
                self._route(self._pending[:at], reasoning, content)
                # An end marker is consumed; a next header's marker begins its header.
                self._pending = self._pending[at + len(boundary) if boundary in ENDS else at :]
                self._close(deltas)
        return "".join(reasoning), "".join(content), deltas

    def finish(
        self, finish_reason: str | None, stop_reason: int | str | None = None
    ) -> tuple[str, str, list[dict[str, Any]]]:
        """What was held back, at the end of the output: the last message's rest, a call
        whole where the output stopped on a stop token (``<|call|>``), as content where it
        was cut short (``max_tokens``, or a stop string, ``stop_reason``); an unfinished
        header is markup, dropped."""
        reasoning: list[str] = []
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        pending, self._pending = self._pending, ""
        if self._state in ("open", "plain"):
            content.append(pending)
        elif self._state == "body":
            self._route(pending, reasoning, content)
            stopped_on_token = finish_reason == "stop" and not isinstance(stop_reason, str)
            if self._call is not None and not stopped_on_token:
                content.append("".join(self._arguments))
                self._call = None
            self._close(deltas)
        return "".join(reasoning), "".join(content), deltas

    def _open(self, header: str) -> None:
        channel = _CHANNEL_NAME.search(header)
        self._channel = channel.group(1) if channel else ""
        recipient = _RECIPIENT.search(header)
        to = recipient.group(1) if recipient else ""
        calls = self.calls is not None and to.startswith(FUNCTIONS)
        self._call = to.removeprefix(FUNCTIONS) if calls else None
        self._arguments = []
        if self._channel == "analysis" and self._call is None:
            self.reasoned = True
        self._state = "body"

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._call is not None:
            self._arguments.append(text)
        elif self._channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)

    def _close(self, deltas: list[dict[str, Any]]) -> None:
        if self._call is not None:
            assert self.calls is not None
            call = ToolCall(self._call, "".join(self._arguments).strip())
            deltas.append(call.delta(len(self.calls)))
            self.calls.append(call)
            self._call = None
        self._state = "between"
