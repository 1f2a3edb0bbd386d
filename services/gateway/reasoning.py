"""A thinking model's reasoning read out of its text: ``<think>...</think>``, as vLLM's
``--reasoning-parser deepseek_r1``, ``qwen3``, ``glm45``, ``minimax_m2`` and ``kimi_k2`` read it, or ``[THINK]...[/THINK]`` (``mistral``:
Magistral's, its markers special tokens).

A thinking model's template may open the reasoning in the prompt (DeepSeek-R1, newer
Qwen3), or the model writes ``<think>`` itself: so while a request thinks, its text is
reasoning up to the first ``</think>`` (all of it, if cut short before), an opening tag left
out. A request that does not think (Qwen3 asked with ``enable_thinking: false``, or an output
held to a format from its first token) is content, unless its text opens with ``<think>``.
"""

from __future__ import annotations

from weir.services.gateway.tool_calls import tag_prefix_at_end

# glm45: GLM-4.5's to 4.7's, as qwen3's; minimax_m2 and kimi_k2: MiniMax-M2's and Kimi K2
# Thinking's, as deepseek_r1's. The last: harmony.py.
REASONING_PARSERS = (
    "deepseek_r1",
    "qwen3",
    "glm45",
    "minimax_m2",
    "kimi_k2",
    "mistral",
    "openai_gptoss",
)

START, END = "<think>", "</think>"
# Each parser's reasoning markers (the others': START and END).
MARKERS = {"mistral": ("[THINK]", "[/THINK]")}


class ReasoningReader:
    """One choice's text, as it streams, split into reasoning and content; held back: what
    may begin a tag. Fed piece by piece it splits as it does the whole text."""

    def __init__(self, thinking: bool, markers: tuple[str, str] = (START, END)) -> None:
        self._thinking = thinking
        self._start, self._end = markers
        self._pending = ""
        self._state = "open"  # the start is not known yet; then "reasoning", "content"
        self.reasoned = False  # whether the text holds reasoning (maybe empty)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` completes."""
        self._pending += text
        if self._state == "open":
            head = self._pending.lstrip()
            if head.startswith(self._start):
                self._pending = head[len(self._start) :]
                self._enter("reasoning")
            elif self._start.startswith(head):
                return "", ""
            else:
                self._enter("reasoning" if self._thinking else "content")
        reasoning = ""
        if self._state == "reasoning":
            end = self._pending.find(self._end)
            if end < 0:
                keep = tag_prefix_at_end(self._pending, self._end)
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return reasoning, ""
            reasoning, self._pending = self._pending[:end], self._pending[end + len(self._end) :]
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
