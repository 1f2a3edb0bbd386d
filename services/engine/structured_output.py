"""Structured outputs (vLLM's): a request's output held to a JSON schema, any JSON object, a
regular expression, a list of choices, an EBNF grammar or a structural tag (xgrammar's:
free text with tagged parts held to schemas, or its composable formats).

xgrammar compiles the constraint against the model's vocabulary once per distinct spec (its
compiler caches them) and gives each request a matcher: before a step that samples for the
request, the matcher's bitmask of the tokens allowed next travels in the step plan and the
executor masks every other token; after the step, the sampled token advances the matcher.
The end tokens are allowed only where the constraint is complete, so a request ends, on its
end token, with an output the constraint accepts (unless ``max_tokens`` cuts it short).
Speculative drafts are cut to the longest prefix the constraint allows (``allowed_drafts``),
and a step that verifies them carries a mask per position: after each draft, as if it were
accepted (the matcher advances through them and rolls back).
With a ``reasoning_end`` token (a thinking model's ``</think>``), the output is free until
that token and held to the constraint after it, as vLLM treats reasoning models.
xgrammar is imported on the first such request (a few seconds, in the tokenizer thread).
A JSON schema is checked first for what xgrammar 0.2.9 would drop without a word
(``check_json_schema``): such a request is refused, as vLLM's xgrammar backend refuses it,
rather than answered with output the schema does not accept.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from itertools import takewhile
from typing import Any

from weir.services.engine.json_schema_check import check_json_schema
from weir.shared.sampling import STRUCTURED_OUTPUT_KINDS
from weir.shared.tokenizer import Tokenizer

_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")


# A matcher's work for one token (a mask, or a token accepted) may take this long this many
# times in a row before its request is ended (``RequestGrammar.too_costly``): an ambiguous
# grammar's Earley matcher (``s ::= s s s | s s | "a" | ""``) costs about the cube of the
# output's length, and the scheduler waits on it between every two steps of every request.
# A mask of an unambiguous grammar takes microseconds to a millisecond; three in a row keep a
# busy machine's passing stall from ending a request.
GRAMMAR_TOKEN_LIMIT_S = 0.05
_SLOW_IN_A_ROW = 3


class RequestGrammar:
    """One request's place in its constraint (see ``Scheduler``: ``allowed_drafts`` for the
    drafts proposed, ``bitmask`` before a step that samples for it, ``accept`` for each token
    sampled)."""

    __slots__ = ("_matcher", "_bitmask", "_reasoning_end", "_slow", "last_cost_s")

    def __init__(self, matcher: Any, bitmask: Any, reasoning_end: int | None = None) -> None:
        self._matcher, self._bitmask = matcher, bitmask
        self._reasoning_end = reasoning_end  # None once the constraint holds
        self._slow = 0  # calls in a row over GRAMMAR_TOKEN_LIMIT_S
        self.last_cost_s = 0.0

    @property
    def too_costly(self) -> bool:
        """Whether following the constraint has cost over ``GRAMMAR_TOKEN_LIMIT_S`` a token
        for a while: the request is to end, as it slows every other."""
        return self._slow >= _SLOW_IN_A_ROW

    def _timed(self, start: float) -> None:
        self.last_cost_s = cost = time.perf_counter() - start
        self._slow = self._slow + 1 if cost > GRAMMAR_TOKEN_LIMIT_S else 0

    def bitmask(self, drafts: Sequence[int] = ()) -> bytes | None:
        """The tokens allowed next, bit ``t % 32`` of little-endian int32 word ``t // 32``,
        and for a step that verifies ``drafts`` (``allowed_drafts``' own) the tokens allowed
        after each of them, one such mask a position, concatenated; None while the model
        reasons (any token: its drafts then hold no reasoning end)."""
        if self._reasoning_end is not None:
            return None
        start = time.perf_counter()
        masks = [self._next_mask()]
        for token in drafts:
            if not self._matcher.accept_token(token):
                raise ValueError(f"draft token {token} breaks the structured output")
            masks.append(self._next_mask())
        if drafts:
            self._matcher.rollback(len(drafts))
        self._timed(start)
        return b"".join(masks)

    def allows_any(self, token_ids: Sequence[int]) -> bool:
        """Whether one of ``token_ids`` may come next (any may while the model reasons)."""
        mask = self.bitmask()
        if mask is None:
            return True
        return any(
            int.from_bytes(mask[t // 32 * 4 : t // 32 * 4 + 4], "little") >> (t % 32) & 1
            for t in token_ids
        )

    def allowed_drafts(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of ``drafts`` the constraint allows from here, short of an end
        token (after which no position has a mask); while the model reasons, the drafts
        before its reasoning end."""
        if self._reasoning_end is not None:
            return list(takewhile(self._reasoning_end.__ne__, drafts))
        matcher = self._matcher
        accepted, ended = 0, False
        for token in drafts:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                ended = True  # an end token: the step samples one itself where allowed
                break
        if accepted:
            matcher.rollback(accepted)
        return list(drafts[: accepted - ended])

    def _next_mask(self) -> bytes:
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return bytes(self._bitmask.numpy().astype("<i4", copy=False).tobytes())

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the constraint does not allow it there."""
        if self._reasoning_end is not None:
            if token_id == self._reasoning_end:
                self._reasoning_end = None
            return True
        start = time.perf_counter()
        accepted = bool(self._matcher.accept_token(token_id))
        self._timed(start)
        return accepted

    def is_terminated(self) -> bool:
        """Whether an end token completed the output."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles requests' constraints for one model (thread-safe; built on first use)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._xgr: Any = None

    def matcher(self, spec: dict[str, Any]) -> RequestGrammar:
        """A new matcher for ``spec`` (``SamplingParams.structured_output``); ValueError
        says what xgrammar could not compile."""
        [(kind, value)] = [(k, v) for k, v in spec.items() if k in STRUCTURED_OUTPUT_KINDS]
        any_whitespace = not spec.get("disable_any_whitespace", False)
        if kind == "json":
            check_json_schema(value)
        elif kind == "structural_tag":
            value = structural_tag_format(value)
            json_parts = list(_json_schema_parts(value))
            for part in json_parts:
                check_json_schema(json.dumps(part["json_schema"]))
        compiler, xgr = self._ready()
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(value, any_whitespace=any_whitespace)
            elif kind == "json_object":
                # An object, as OpenAI's JSON mode promises (xgrammar's built-in JSON grammar
                # takes any value: an array too).
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(value)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(value))
            elif kind == "structural_tag":
                if not any_whitespace:
                    for part in json_parts:
                        _compact(part, xgr)
                compiled = compiler.compile_structural_tag(value)
            else:
                compiled = compiler.compile_grammar(value)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) for a bad spec
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            # Its messages begin with a time and its source file: "[20:50:13] x.cc:94: ".
            message = _XGRAMMAR_PREFIX.sub("", lines[0])
            raise ValueError(f"structured_output.{kind}: cannot compile it: {message}") from None
        reasoning_end = None
        if "reasoning_end" in spec:
            reasoning_end = self._tokenizer.backend.token_to_id(spec["reasoning_end"])
            if reasoning_end is None:
                raise ValueError(
                    f"structured_output.reasoning_end: {spec['reasoning_end']!r} is not a token "
                    "of this model (a reasoning model's tag is one token)"
                )
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        return RequestGrammar(matcher, bitmask, reasoning_end)

    def _ready(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)  # type: ignore[no-untyped-call]
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler, self._xgr = xgr.GrammarCompiler(info, max_threads=1), xgr
            return self._compiler, self._xgr


def structural_tag_format(text: str) -> dict[str, Any]:
    """A structural tag in xgrammar's form: the first form's structures become the tags its
    triggers open (as xgrammar reads its deprecated tags and triggers)."""
    tag = json.loads(text)
    if "structures" in tag:
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s.get("schema", {})},
                "end": s["end"],
            }
            for s in tag["structures"]
        ]
        tag = {"format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}}
    return {"type": "structural_tag", "format": tag["format"]}


def _compact(part: dict[str, Any], xgr: Any) -> None:
    """A JSON part of a structural tag without free whitespace (``disable_any_whitespace``),
    as its schema's grammar: xgrammar's format bounds a run of whitespace, but not to none."""
    if part.get("style", "json") == "json":
        text = json.dumps(part["json_schema"])
        grammar = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
        part.clear()
        part.update(type="grammar", grammar=grammar)


def _json_schema_parts(tag: Any) -> Iterator[dict[str, Any]]:
    """Each part of a structural tag's format that is JSON of a schema, wherever it nests."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are
    xgrammar's too)."""
    # Characters as they are: xgrammar reads \u escapes one UTF-16 unit at a time, so an
    # escaped character past U+FFFF would become two unpaired surrogates.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
