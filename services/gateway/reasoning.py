"""A thinking model's reasoning read out of its text: ``<think>...</think>``, as vLLM's
``--reasoning-parser deepseek_r1``, ``qwen3``, ``glm45`` (``glm47``), ``minimax_m2``, ``kimi_k2``,
``olmo3``, ``deepseek_v3`` and ``holo2`` read it, or ``[THINK]...[/THINK]`` (``mistral``:
Magistral's, its markers special tokens), or ``Here's my thought process:...Here's my
response:`` (``granite``: Granite 3.2's and 3.3's, asked to think, "Here is" too);
``minimax_m2_append_think`` leaves it in the content, ``<think>`` put first.

A thinking model's template may open the reasoning in the prompt (DeepSeek-R1, newer
Qwen3), or the model writes ``<think>`` itself: so while a request thinks, its text is
reasoning up to the first ``</think>`` (all of it, if cut short before), an opening tag left
out. A request that does not think (Qwen3 asked with ``enable_thinking: false``, DeepSeek-V3.1
not asked with ``thinking: true``, an output held to a format from its first token, or any
under ``mistral`` and ``granite``, whose models open their reasoning themselves) is content,
unless its text opens with the start.
Under ``qwen3`` a ``<tool_call>`` also ends the reasoning, unclosed, and opens the content
(Qwen3 may call a tool before its ``</think>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from weir.services.gateway.tool_calls import tag_prefix_at_end

# glm45 (or glm47, vLLM's other name): GLM-4.5's to 4.7's, as qwen3's; minimax_m2, kimi_k2
# and olmo3: MiniMax-M2's, Kimi K2 Thinking's and OLMo 3 Think's, as deepseek_r1's;
# minimax_m2_append_think: MiniMax-M2's, all content, ``<think>`` put first (Markers.inline);
# deepseek_v3 and holo2: DeepSeek-V3.1's and Holo2's, as deepseek_r1's where the request
# thinks (schemas.py says which do); granite: Granite 3.2's and 3.3's. The last: harmony.py.
REASONING_PARSERS = (
    "deepseek_r1",
    "qwen3",
    "glm45",
    "glm47",
    "minimax_m2",
    "minimax_m2_append_think",
    "kimi_k2",
    "olmo3",
    "deepseek_v3",
    "holo2",
    "mistral",
    "granite",
    "openai_gptoss",
)

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Markers:
    """A parser's reasoning markers: each a string, or a tuple of the spellings that mark
    alike."""

    start: str | tuple[str, ...] = START
    end: str | tuple[str, ...] = END
    # What ends the reasoning unclosed and opens the content, kept in it: Qwen3's tool call
    # written before its ``</think>`` (vLLM's qwen3 parser reads it so); "" for none.
    call: str = ""
    # Whether the reasoning stays in the content, ``start`` put before it (the template opened
    # it in the prompt): vLLM's minimax_m2_append_think, for clients that send the thought back
    # as content.
    inline: bool = False


# Each parser's (the others': Markers()).
MARKERS = {
    "mistral": Markers("[THINK]", "[/THINK]"),
    "qwen3": Markers(call="<tool_call>"),
    # vLLM's granite parser takes "Here's" for "Here is", which quantized models write.
    "granite": Markers(
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
    ),
    "minimax_m2_append_think": Markers(inline=True),
}


def _spellings(marker: str | tuple[str, ...]) -> tuple[str, ...]:
    return (marker,) if isinstance(marker, str) else marker


class ReasoningReader:
    """One choice's text, as it streams, split into reasoning and content; held back: what
    may begin a tag. Fed piece by piece it splits as it does the whole text."""

    def __init__(self, thinking: bool, markers: Markers = Markers()) -> None:
        self._thinking = thinking
        self._starts, self._ends = _spellings(markers.start), _spellings(markers.end)
        self._call = markers.call
        self._pending = self._starts[0] if markers.inline else ""
        # "open": the start is not known yet; then "reasoning", "content"
        self._state = "content" if markers.inline else "open"
        self.reasoned = False  # whether the text holds reasoning (maybe empty)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` completes."""
        self._pending += text
        if self._state == "open":
            head = self._pending.lstrip()
            start = next((s for s in self._starts if head.startswith(s)), None)
            if start is not None:
                self._pending = head[len(start) :]
                self._enter("reasoning")
            elif any(s.startswith(head) for s in self._starts):
                return "", ""
            else:
                self._enter("reasoning" if self._thinking else "content")
        reasoning = ""
        if self._state == "reasoning":
            end, end_marker = min(
                ((at, e) for e in self._ends if (at := self._pending.find(e)) >= 0),
                default=(-1, ""),
            )
            call = self._pending.find(self._call) if self._call else -1
            if 0 <= call and (end < 0 or call < end):
                reasoning, self._pending = self._pending[:call], self._pending[call:]
            elif end < 0:
                keep = max(tag_prefix_at_end(self._pending, e) for e in self._ends)
                if self._call:
                    keep = max(keep, tag_prefix_at_end(self._pending, self._call))
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return reasoning, ""
            else:
                reasoning = self._pending[:end]
                self._pending = self._pending[end + len(end_marker) :]
            self._state = "content"
        content, self._pending = self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "open":
            self._enter("reasoning" if self._thinking else "content")
        return (pending, "") if self._state == "reasoning" else ("", pending)

    def _enter(self, state: str) -> None:
        self._state = state
        self.reasoned = state == "reasoning"
