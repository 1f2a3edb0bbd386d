"""Per-request sampling parameters, validated on construction.

``SamplingParams`` travels on the wire as a plain dict (``to_dict``/``from_dict``);
``from_dict`` checks every type, so a bad client request becomes a ``ValueError``
naming the field instead of a crash in the executor.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from typing import Any

# The most logprobs a request may ask for unless the server says otherwise (--max-logprobs):
# vLLM's default, and OpenAI's cap on top_logprobs.
DEFAULT_MAX_LOGPROBS = 20
# Counts (max_tokens, min_tokens, top_k) must fit the executor's int32 columns.
MAX_COUNT = 2**31 - 1
# A temperature below vLLM's sampling epsilon is greedy: dividing logits by it overflows.
GREEDY_TEMPERATURE = 1e-5
# Every stop string is searched for in each request's text at every step.
MAX_STOP_STRINGS = 64
# Every bad word's sequences are matched against a row's last outputs at every step: a few
# short words, as vLLM's users give them (64 texts, each tokenized up to twice).
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 32
MAX_BAD_WORD_SEQUENCES = 2 * MAX_STOP_STRINGS
# OpenAI's ranges for the additive penalties and the logit biases.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# Past these a repetition penalty turns a logit into 0 or infinity in float32.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _int(name: str, value: Any, minimum: int, maximum: int = MAX_COUNT) -> int:
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range (a float is in it)
        raise ValueError(
            f"{name} must be finite, got an int of {int(value).bit_length()} bits"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return number


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request's n (vLLM's ``seed + index``, wrapped into
    int64): the n samples differ, yet reproduce."""
    if seed is None or seed == -1:  # -1: unseeded, as vLLM's SamplingParams takes it
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    ``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``max_tokens=None``
    asks for as many tokens as fit in ``max_model_len`` after the prompt (the scheduler's
    door refuses a ``max_tokens`` that does not fit). ``top_k == 0`` (or -1) disables top-k;
    ``top_p == 1`` and ``min_p == 0`` disable those filters. ``stop`` holds text stop
    strings (matched by the detokenizer, not the scheduler); ``stop_token_ids`` and
    EOS (unless ``ignore_eos``) are matched by the scheduler. No stop applies before
    ``min_tokens`` outputs; the text of what stopped a request (a stop string, a stop token)
    is left out unless ``include_stop_str_in_output``, and special tokens' text unless
    ``skip_special_tokens`` is False (vLLM's); ``detokenize=False`` (vLLM's) returns token ids
    and no text, and takes no stop strings. ``logprobs=n`` returns the sampled token's logprob and the
    top-n alternatives per output token (``None`` = no logprobs); ``prompt_logprobs=n`` the
    same for each prompt token after the first (vLLM's: the prompt is computed in full, never
    read from the prefix cache). ``truncate_prompt_tokens=k`` keeps the prompt's last ``k``
    tokens (-1: as many as leave room for one output token), as vLLM's.

    Penalties follow vLLM (and OpenAI): ``presence_penalty`` is subtracted from the logit of
    every token the output holds so far, ``frequency_penalty`` times its count;
    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every
    token in the prompt or the output (1 = off). ``logit_bias`` holds (token id, bias) pairs
    added to those logits (a dict is taken too). ``allowed_token_ids`` (vLLM's) are the only
    tokens the output may hold (None: any). The allowed tokens are masked first, then biases
    and penalties apply; the logprobs returned stay those of the raw model. ``bad_words``
    (vLLM's): the output never holds one of these texts' tokens in a row, as each tokenizes
    alone and after a space; the server fills ``bad_words_token_ids`` with those token
    sequences (given directly, they are taken as they are): a sequence's last token is banned
    wherever the output's last tokens are the ones before it.

    ``structured_output`` (vLLM's structured outputs) constrains the output to one of:
    ``{"json": schema}`` (a JSON schema, as a dict or its text), ``{"json_object": True}``
    (any JSON object), ``{"regex": pattern}``, ``{"choice": [strings]}`` or
    ``{"grammar": ebnf}`` (xgrammar's EBNF); the server compiles it and refuses one it cannot.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_output: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's: sequences to sample of the prompt, each its own request (seed + i where seeded)
    # sent by ``LLM`` (the HTTP API takes its own ``n``); a server samples one a request.
    n: int = 1

    def __post_init__(self) -> None:
        # frozen: normalised values are written with object.__setattr__.
        put = object.__setattr__
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("n", self.n, 1)
        temperature = _float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        put(self, "temperature", 0.0 if temperature < GREEDY_TEMPERATURE else temperature)
        top_p = _float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put(self, "top_p", top_p)
        if self.top_k == -1:
            put(self, "top_k", 0)
        _int("top_k", self.top_k, 0)
        min_p = _float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put(self, "min_p", min_p)
        if self.seed == -1:  # vLLM's: unseeded (web UIs send -1 for "random")
            put(self, "seed", None)
        if self.seed is not None:
            _int("seed", self.seed, -(2**63), 2**63 - 1)
        # vLLM's None for none (a caller passing its optional arguments on).
        for name in ("stop", "stop_token_ids", "logit_bias", "bad_words"):
            if getattr(self, name) is None:
                put(self, name, ())
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(type(s) is str and s for s in stop):
            raise ValueError("stop must be a string or a sequence of non-empty strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        put(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {type(ids).__name__}")
        for token_id in ids:  # the vocabulary bound is the scheduler's (it knows the model)
            _int("stop_token_ids", token_id, 0)
        # Each id once: the executor bans these (before min_tokens) on every step.
        put(self, "stop_token_ids", tuple(dict.fromkeys(ids)))
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if stop and not self.detokenize:
            raise ValueError("stop strings are matched in the text: they need detokenize=True")
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):  # the server's --max-logprobs bounds them
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0)
        for name in ("presence_penalty", "frequency_penalty"):
            penalty = _float(name, getattr(self, name))
            if not -MAX_PENALTY <= penalty <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {penalty}"
                )
            put(self, name, penalty)
        repetition = _float("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= repetition <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {repetition}")
        put(self, "repetition_penalty", repetition)
        put(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 or at least 1, got 0")
        if self.structured_output is not None:
            put(self, "structured_output", _structured_output(self.structured_output))
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (list, tuple)) or not allowed:
                raise ValueError("allowed_token_ids must be a non-empty sequence of token ids")
            for token_id in allowed:  # the vocabulary bound is the scheduler's
                _int("allowed_token_ids", token_id, 0)
            put(self, "allowed_token_ids", tuple(dict.fromkeys(allowed)))
        words = self.bad_words
        if not isinstance(words, (list, tuple)) or not all(
            type(w) is str and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in words
        ):
            raise ValueError(
                "bad_words must be a sequence of texts, each more than spaces and at most "
                f"{MAX_BAD_WORD_CHARS} characters"
            )
        if len(words) > MAX_STOP_STRINGS:
            raise ValueError(f"bad_words may hold at most {MAX_STOP_STRINGS}, got {len(words)}")
        put(self, "bad_words", tuple(words))
        sequences = self.bad_words_token_ids
        if not isinstance(sequences, (list, tuple)) or len(sequences) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(
                f"bad_words_token_ids must be at most {MAX_BAD_WORD_SEQUENCES} token sequences"
            )
        for sequence in sequences:
            if (
                not isinstance(sequence, (list, tuple))
                or not sequence
                or len(sequence) > MAX_BAD_WORD_TOKENS
            ):
                raise ValueError(
                    "bad_words_token_ids must hold token id sequences of 1 to "
                    f"{MAX_BAD_WORD_TOKENS} tokens"
                )
            for token_id in sequence:
                _int("bad_words_token_ids", token_id, 0)
        put(self, "bad_words_token_ids", tuple(tuple(seq) for seq in sequences))

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack/JSON-friendly dict (tuples become lists)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "detokenize": self.detokenize,
            "structured_output": self.structured_output,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": [list(pair) for pair in self.logit_bias],
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "allowed_token_ids": (
                None if self.allowed_token_ids is None else list(self.allowed_token_ids)
            ),
            "bad_words": list(self.bad_words),
            "bad_words_token_ids": [list(seq) for seq in self.bad_words_token_ids],
            **({"n": self.n} if self.n != 1 else {}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        """Build from a dict; missing keys take defaults, unknown keys or wrong types
        raise ``ValueError`` naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling params must be a dict, got {type(data).__name__}")
        unknown = [k for k in data if k not in _FIELD_NAMES]
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {sorted(map(str, unknown))}")
        return cls(**data)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from pairs or a dict, each id once (the vocabulary bound is the
    scheduler's, as for stop_token_ids)."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"logit_bias must map token ids to biases, got {type(value).__name__}")
    bias: dict[int, float] = {}
    # Up to a whole vocabulary of pairs, checked once per process they pass (gateway,
    # scheduler, executor): the common case costs two type checks and a comparison.
    for pair in pairs:
        if type(pair) not in (list, tuple) or len(pair) != 2:
            raise ValueError("logit_bias must hold (token id, bias) pairs")
        token_id, value = pair
        if type(token_id) is not int or not 0 <= token_id <= MAX_COUNT:
            _int("logit_bias token id", token_id, 0)
        if token_id in bias:  # "5" and "05" in JSON: which one is meant?
            raise ValueError(f"logit_bias: token id {token_id} is given twice")
        if type(value) is not float:
            value = _float(f"logit_bias[{token_id}]", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN too
            raise ValueError(
                f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                f"got {value}"
            )
        bias[token_id] = value
    return tuple(bias.items())


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# disable_any_whitespace (vLLM's): JSON without free whitespace between tokens (a weak model
# may otherwise write whitespace until max_tokens).
# reasoning_end: the token that ends a thinking model's reasoning, which the constraint
# follows (the reasoning is free), as vLLM holds a reasoning model's output to a format.
# vLLM's other options, either value served as its xgrammar backend serves it:
# disable_fallback (one backend here, which never falls back) and
# disable_additional_properties (xgrammar closes an object that lists properties to them,
# unless it says otherwise, as the option asks); whitespace_pattern only unset (null).
STRUCTURED_OUTPUT_OPTIONS = (
    "disable_any_whitespace",
    "reasoning_end",
    "disable_fallback",
    "disable_additional_properties",
    "whitespace_pattern",
)
# A spec's characters (a choice list's in all): compiling one holds the tokenizer thread
# every other request's long prompt waits for (a 17.8 kB schema took 1.3 s).
MAX_STRUCTURED_OUTPUT_CHARS = 1 << 16
# A JSON schema's nesting (objects and arrays within each other): its compile time grows
# as about its cube (xgrammar, 2 cores: 64 objects deep, 128 levels, 0.10 s; 100 deep
# 0.31 s; 150 deep 1.05 s; a 27 kB schema 450 deep held the thread 29 s).
MAX_JSON_SCHEMA_DEPTH = 128


def _structured_output(value: Any) -> dict[str, Any]:
    """One kind of constraint and its spec, checked for type (the server compiles it), and
    the options that shape it (``disable_any_whitespace``, ``reasoning_end``). A key set to
    null is unset, as in vLLM's ``StructuredOutputsParams`` (a client that sends the whole
    object sends its unset fields so)."""
    if not isinstance(value, dict):
        raise ValueError(
            f"structured_output must be a map of one of {list(STRUCTURED_OUTPUT_KINDS)} to its "
            f"spec, got {type(value).__name__}"
        )
    value = {k: v for k, v in value.items() if v is not None}
    options = {k: v for k, v in value.items() if k in STRUCTURED_OUTPUT_OPTIONS}
    kinds = [k for k in value if k not in options]
    unknown = [k for k in kinds if k not in STRUCTURED_OUTPUT_KINDS]
    if unknown:
        raise ValueError(
            f"structured_output: unknown key {str(unknown[0])[:100]!r}; the kinds are "
            f"{list(STRUCTURED_OUTPUT_KINDS)} and the options {list(STRUCTURED_OUTPUT_OPTIONS)}"
        )
    if len(kinds) != 1:
        named = " and ".join(map(str, kinds)) or "none"
        raise ValueError(f"structured_output: ask for one kind of output, got {named}")
    for option in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
        if type(options.get(option, False)) is not bool:
            raise ValueError(f"structured_output.{option} must be a bool")
    if "whitespace_pattern" in options:
        raise ValueError(
            "structured_output.whitespace_pattern is not supported (disable_any_whitespace "
            "writes JSON with no whitespace between its tokens)"
        )
    end = options.get("reasoning_end", "-")
    if type(end) is not str or not 0 < len(end) <= 64:
        raise ValueError("structured_output.reasoning_end must be a token's text (1-64 characters)")
    [kind] = kinds
    spec = value[kind]
    if kind in ("json", "structural_tag") and isinstance(spec, dict):
        spec = json.dumps(spec)
    if kind == "structural_tag":
        check_structural_tag(spec)
    if kind == "json_object":
        if spec is not True:
            raise ValueError("structured_output.json_object must be true")
    elif kind == "choice":
        if (
            not isinstance(spec, (list, tuple))
            or not spec
            or not all(type(c) is str and c for c in spec)
        ):
            raise ValueError("structured_output.choice must be a list of non-empty strings")
        spec = list(spec)
    elif type(spec) is not str or not spec:
        raise ValueError(f"structured_output.{kind} must be a non-empty string")
    size = sum(map(len, spec)) if kind == "choice" else len(spec) if kind != "json_object" else 0
    if size > MAX_STRUCTURED_OUTPUT_CHARS:
        raise ValueError(
            f"structured_output.{kind}: {size} characters, more than this server compiles "
            f"({MAX_STRUCTURED_OUTPUT_CHARS})"
        )
    if kind in ("json", "structural_tag") and _json_depth(spec) > MAX_JSON_SCHEMA_DEPTH:
        raise ValueError(
            f"structured_output.{kind}: the schema nests objects and arrays more than "
            f"{MAX_JSON_SCHEMA_DEPTH} levels deep, more than this server compiles"
        )
    return {kind: spec, **options}


def check_structural_tag(spec: Any) -> None:
    """A structural tag (vLLM's and SGLang's ``structural_tag``, xgrammar's) as JSON text:
    its first form, ``{"structures": [{"begin", "schema", "end"}...], "triggers": [...]}``
    (free text until a trigger, which opens the structure whose ``begin`` it starts), or
    xgrammar's ``{"type": "structural_tag", "format": {...}}``, whose format the compiler
    checks. ValueError says what is wrong with the first."""
    where = "structured_output.structural_tag"
    if type(spec) is not str or not spec:
        raise ValueError(f"{where} must be a non-empty string (JSON) or an object")
    try:
        tag = json.loads(spec)
    except ValueError:
        raise ValueError(f"{where} is not JSON") from None
    if not isinstance(tag, dict) or ("structures" in tag) == ("format" in tag):
        raise ValueError(
            f'{where} must be an object of "structures" and "triggers", or of "format"'
        )
    if "format" in tag:
        return
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not all(
        isinstance(s, dict)
        and type(s.get("begin")) is str
        and type(s.get("end")) is str
        and isinstance(s.get("schema", {}), dict | bool | None)
        and s.keys() <= {"begin", "schema", "end"}
        for s in structures
    ):
        raise ValueError(
            f'{where}.structures must be a list of {{"begin": text, "schema": a JSON schema, '
            '"end": text}'
        )
    if not isinstance(triggers, list) or not all(type(t) is str and t for t in triggers):
        raise ValueError(f"{where}.triggers must be a list of non-empty strings")
    for structure in structures:
        if not any(structure["begin"].startswith(t) for t in triggers):
            raise ValueError(
                f"{where}: no trigger begins the structure {structure['begin'][:100]!r}, "
                "which therefore could never be written"
            )


def _json_depth(text: str) -> int:
    """How deep a JSON text's objects and arrays nest (0 for text that is not JSON: the
    compiler names its fault)."""
    try:
        value = json.loads(text)
    except RecursionError:
        return sys.getrecursionlimit()
    except ValueError:
        return 0
    depth, level = 0, [(value, 1)]
    while level:
        node, at = level.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, at)
            level.extend(
                (child, at + 1) for child in (node.values() if isinstance(node, dict) else node)
            )
    return depth


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
