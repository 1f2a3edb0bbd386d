"""A thinking model's reasoning read out of its text: ``<think>...</think>``, as vLLM's
``--reasoning-parser deepseek_r1``, ``qwen3``, ``glm45`` (``glm47``), ``minimax_m2``, ``kimi_k2``,
``olmo3``, ``deepseek_v3`` and ``holo2`` read it, or ``[THINK]...[/THINK]`` (``mistral``:
Magistral's, its markers special tokens), or ``Here's my thought process:...Here's my
response:`` (``granite``: Granite 3.2's and 3.3's, asked to think, "Here is" too), or
``<seed:think>...</seed:think>`` (``seed_oss``: Seed-OSS', its budget reflections,
``<seed:cot_budget_reflect>...``, left in the reasoning), or ``<|channel>thought\n...<channel|>``
(``gemma4``: Gemma 4's, its markers special tokens, the ``thought`` label no reasoning);
``minimax_m2_append_think`` leaves
it in the content, ``<think>`` put first. ``hunyuan_a13b`` (Hunyuan's
``<think>\n...\n</think>\n<answer>\n...\n</answer>``) and ``ernie45`` (ERNIE 4.5 Thinking's
``...</think>`` then ``<response>...</response>``) also take the answer out of its tags: the
content is what they hold, the whitespace before them and anything after them left out.

A thinking model's template may open the reasoning in the prompt (DeepSeek-R1, newer
Qwen3), or the model writes ``<think>`` itself: so while a request thinks, its text is
reasoning up to the first ``</think>`` (all of it, if cut short before), an opening tag left
out. A request that does not think (Qwen3 asked with ``enable_thinking: false``, DeepSeek-V3.1
not asked with ``thinking: true``, an output held to a format from its first token, or any
under ``mistral``, ``granite``, ``hunyuan_a13b`` and ``gemma4``, whose models open their
reasoning themselves) is content, unless its text opens with the start.
Under ``qwen3`` a ``<tool_call>`` also ends the reasoning, unclosed, and opens the content
(Qwen3 may call a tool before its ``</think>``), as Gemma 4's ``<|tool_call>`` does under
``gemma4``.
"""

from __future__ import annotations

from dataclasses import dataclass

from weir.services.gateway.json_calls import tag_prefix_at_end

# glm45 (or glm47, vLLM's other name): GLM-4.5's to 4.7's, as qwen3's; minimax_m2, kimi_k2
# and olmo3: MiniMax-M2's, Kimi K2 Thinking's and OLMo 3 Think's, as deepseek_r1's;
# minimax_m2_append_think: MiniMax-M2's, all content, ``<think>`` put first (Markers.inline);
# deepseek_v3 and holo2: DeepSeek-V3.1's and Holo2's, as deepseek_r1's where the request
# thinks (schemas.py says which do); seed_oss: Seed-OSS', ernie45: ERNIE 4.5 Thinking's, both
# as deepseek_r1's; hunyuan_a13b: Hunyuan's, whose prompt opens no reasoning; granite: Granite
# 3.2's and 3.3's; gemma4: Gemma 4's channel. The last: harmony.py.
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
    "seed_oss",
    "hunyuan_a13b",
    "ernie45",
    "mistral",
    "granite",
    "gemma4",
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
    # written before its ``</think>`` (vLLM's qwen3 parser reads it so), Gemma 4's; "" for
    # none.
    call: str = ""
    # What the model writes right after ``start`` that names the channel and is no reasoning:
    # Gemma 4's ``thought\n`` (vLLM's gemma4 parser strips it); "" for none.
    label: str = ""
    # The tags the answer is written in, not content: Hunyuan's <answer>, ERNIE's
    # <response>; ("", "") for none.
    answer: tuple[str, str] = ("", "")
    # Whether one newline inside each tag belongs to the tag (Hunyuan writes its tags on
    # lines of their own, and vLLM's parser reads them so), not to the text.
    newlines: bool = False
    # Whether the reasoning stays in the content, ``start`` put before it (the template opened
    # it in the prompt): vLLM's minimax_m2_append_think, for clients that send the thought back
    # as content.
    inline: bool = False
    # Whether the markers are special tokens, which the text must be detokenized with
    # (vLLM's mistral and gemma4 parsers set skip_special_tokens false).
    special: bool = False

    @property
    def one_end(self) -> str | None:
        """The end marker where it has one spelling: a structured output may hold after it."""
        return self.end if isinstance(self.end, str) else None


# Each parser's (the others': Markers()).
MARKERS = {
    "mistral": Markers("[THINK]", "[/THINK]", special=True),
    "qwen3": Markers(call="<tool_call>"),
    "seed_oss": Markers("<seed:think>", "</seed:think>"),
    "hunyuan_a13b": Markers(answer=("<answer>", "</answer>"), newlines=True),
    "ernie45": Markers(answer=("<response>", "</response>")),
    # vLLM's granite parser takes "Here's" for "Here is", which quantized models write.
    "granite": Markers(
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
    ),
    "minimax_m2_append_think": Markers(inline=True),
    "gemma4": Markers(
        "<|channel>", "<channel|>", call="<|tool_call>", label="thought\n", special=True
    ),
}


def markers_of(parser: str | None) -> Markers:
    """The reasoning parser's markers (``<think>``'s for those that use them, or none)."""
    return MARKERS.get(parser or "", Markers())


def _spellings(marker: str | tuple[str, ...]) -> tuple[str, ...]:
    return (marker,) if isinstance(marker, str) else marker


class ReasoningReader:
    """One choice's text, as it streams, split into reasoning and content; held back: what
    may begin a tag. Fed piece by piece it splits as it does the whole text."""

    def __init__(self, thinking: bool, markers: Markers = Markers()) -> None:
        self._thinking = thinking
        self._starts, self._ends = _spellings(markers.start), _spellings(markers.end)
        self._call = markers.call
        # Hunyuan's: the reasoning's end held back with the newline before it.
        newline_ends = tuple("\n" + e for e in self._ends) if markers.newlines else ()
        self._held = self._ends + newline_ends
        self._newlines = markers.newlines
        # What the start tag carries that is no reasoning: Hunyuan's newline, Gemma 4's label.
        self._label = "\n" if markers.newlines else markers.label
        self._answer = AnswerReader(markers) if markers.answer[0] else None
        self._pending = self._starts[0] if markers.inline else ""
        # "open": the start is not known yet; then "reasoning", "content"
        self._state = "content" if markers.inline else "open"
        self._opening = False  # whether the start tag's label may come yet
        self.reasoned = False  # whether the text holds reasoning (maybe empty)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` completes."""
        reasoning, content = self._split(text)
        return reasoning, self._answer.feed(content) if self._answer else content

    def finish(self) -> tuple[str, str]:
        """The text held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "open":
            self._enter("reasoning" if self._thinking else "content")
        if self._state == "reasoning":
            # A label cut short (the output ended on it) is no reasoning either.
            cut_label = self._opening and self._label.startswith(pending)
            return ("" if cut_label else pending), ""
        if self._answer is None:
            return "", pending
        return "", self._answer.feed(pending) + self._answer.finish()

    def _split(self, text: str) -> tuple[str, str]:
        self._pending += text
        if self._state == "open":
            head = self._pending.lstrip()
            start = next((s for s in self._starts if head.startswith(s)), None)
            if start is not None:
                self._pending = head[len(start) :]
                self._enter("reasoning")
                self._opening = bool(self._label)
            elif any(s.startswith(head) for s in self._starts):
                return "", ""
            else:
                self._enter("reasoning" if self._thinking else "content")
        reasoning = ""
        if self._state == "reasoning":
            if self._opening:
                if self._label.startswith(self._pending):  # the label, maybe cut short yet
                    return "", ""
                self._pending = self._pending.removeprefix(self._label)
                self._opening = False
            end, end_marker = min(
                ((at, e) for e in self._ends if (at := self._pending.find(e)) >= 0),
                default=(-1, ""),
            )
            call = self._pending.find(self._call) if self._call else -1
            if 0 <= call and (end < 0 or call < end):
                reasoning, self._pending = self._pending[:call], self._pending[call:]
            elif end < 0:
                keep = max(tag_prefix_at_end(self._pending, tag) for tag in self._held)
                if self._call:
                    keep = max(keep, tag_prefix_at_end(self._pending, self._call))
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return reasoning, ""
            else:
                reasoning = self._pending[:end]
                if self._newlines:
                    reasoning = reasoning.removesuffix("\n")
                self._pending = self._pending[end + len(end_marker) :]
            self._state = "content"
        content, self._pending = self._pending, ""
        return reasoning, content

    def _enter(self, state: str) -> None:
        self._state = state
        self.reasoned = state == "reasoning"


class AnswerReader:
    """The content of a format that writes its answer in tags (``Markers.answer``), as it
    streams: where it opens with the tag (whitespace aside), what the tags hold; else the
    text less the whitespace it opens with. Text after the closing tag is not content (the
    answer has ended; vLLM's parsers drop it too)."""

    def __init__(self, markers: Markers) -> None:
        self._open, self._close = markers.answer
        self._newlines = markers.newlines
        self._closes = (self._close, "\n" + self._close) if self._newlines else (self._close,)
        self._pending = ""
        self._state = "head"  # then "answer", "plain" (no tags) or "done"

    def feed(self, text: str) -> str:
        self._pending += text
        if self._state == "head":
            head = self._pending.lstrip()
            if head.startswith(self._open):
                after = head[len(self._open) :]
                if self._newlines and not after:
                    return ""  # the newline that belongs to the tag may come next
                self._pending = after.removeprefix("\n") if self._newlines else after
                self._state = "answer"
            elif not head or self._open.startswith(head):
                return ""
            else:
                self._pending, self._state = head, "plain"
        if self._state == "answer":
            end = self._pending.find(self._close)
            if end < 0:
                keep = max(tag_prefix_at_end(self._pending, tag) for tag in self._closes)
                answer = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return answer
            answer = self._pending[:end]
            self._pending, self._state = "", "done"
            return answer.removesuffix("\n") if self._newlines else answer
        text, self._pending = ("", "") if self._state == "done" else (self._pending, "")
        return text

    def finish(self) -> str:
        """What was held back, at the end of the output: a tag's start cut short is text;
        whitespace alone, before any answer, is none."""
        pending, self._pending = self._pending, ""
        if self._state == "head":
            return pending.lstrip()
        return "" if self._state == "done" else pending
