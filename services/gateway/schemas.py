"""OpenAI request bodies as pydantic models, and their translation to ``SamplingParams``.

Field names are OpenAI's (and vLLM's extensions: ``top_k``, ``min_p``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``repetition_penalty``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``). As in vLLM, ``null`` is a field's default, and the
fields Weir does not implement are accepted at the value that changes nothing
(``_NEUTRAL``), or at any value where none changes the output (``_IGNORED``); any other
value, or an unknown field, is a 400 that names it rather than being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from weir.services.gateway.chat_output import ChatOutput, ChatParsers
from weir.services.gateway.json_calls import parameters_schema, required_schema
from weir.services.gateway.reasoning import markers_of
from weir.services.gateway.tool_calls import ToolChoice
from weir.shared.beam_search import MAX_BEAM_WIDTH
from weir.shared.protocol.client import MAX_ARRAY_LEN, MAX_CACHE_SALT_LEN
from weir.shared.sampling import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    REPETITION_PENALTY_RANGE,
    STRUCTURED_OUTPUT_OPTIONS,
    SamplingParams,
    sample_seed,
)
from weir.shared.sampling_defaults import with_defaults

# Every list stops at its first bad item (fail_fast): pydantic otherwise reports one error
# per item, and listing a million of them (negative token ids, say) held the gateway's
# event loop, every client's, for ten seconds.
# A token id is below 2^31 (every vocabulary is): a larger int is a 400 naming its place,
# not a request the engine's protocol cannot carry.
TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(fail_fast=True)]
# How many logprobs a request asks for: the engine refuses more than its --max-logprobs.
Logprobs = Annotated[int, Field(ge=0, lt=2**31)]
# OpenAI's reasoning efforts and DeepSeek's "max", each one vLLM takes.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def _prompt_form(value: Any) -> str:
    """Which form a prompt takes, told by its first item, so pydantic validates that form
    alone (trying each in turn built an error per item of a long list: 600 MB and a second
    of the event loop for 2M token ids)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "batch"
    return "ids"


def protocol_sized(value: Any) -> Any:
    """A list the engine's protocol cannot carry is refused before its items are checked."""
    if isinstance(value, list) and len(value) > MAX_ARRAY_LEN:
        raise ValueError(f"{len(value)} items; at most {MAX_ARRAY_LEN}")
    return value


def _protocol_sized_map(value: Any) -> Any:
    if isinstance(value, dict) and len(value) > MAX_ARRAY_LEN:
        raise ValueError(f"{len(value)} entries; at most {MAX_ARRAY_LEN}")
    return value


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts"), Field(fail_fast=True)]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Tag("batch"), Field(fail_fast=True)],
    Discriminator(_prompt_form),
    BeforeValidator(protocol_sized),
]


def prompt_list(name: str, prompt: Any) -> list[str | list[int]]:
    """A ``Prompt`` field's prompts: a text or token ids is one, a list of them each;
    ValueError if there are none."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError(f"{name} must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _string_or_list(items: str) -> Discriminator:
    """Validates a string-or-list union as the branch of the value's JSON type (a smart union
    reports every branch's errors, the string's for a list with one bad item)."""
    return Discriminator(
        lambda value: (
            "string" if isinstance(value, str) else "list" if isinstance(value, list) else None
        ),
        custom_error_type="string_or_list",
        custom_error_message=f"Input should be a string or a list of {items}",
    )


Stop = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[str], Tag("list"), Field(fail_fast=True)],
    _string_or_list("strings"),
]


Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# OpenAI's keys are token ids written as strings (JSON's keys are strings).
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
        Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)],
    ],
    Field(fail_fast=True),
    BeforeValidator(_protocol_sized_map),
]


def not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be -1 or at least 1")
    return value


# Fields Weir does not implement, and the one value of each (besides null) that changes
# nothing: accepted and dropped, as vLLM's clients and frameworks send them.
_NEUTRAL: dict[str, Any] = {
    "echo": False,  # a completion's field; in chat, vLLM's, which Weir does not implement
    "best_of": 1,
    "suffix": None,
    "tools": [],  # in completions (chat takes tools)
    "tool_choice": "none",
    "add_generation_prompt": True,
    "spaces_between_special_tokens": True,
}
# Fields that never change the output: accepted with any value and dropped.
_IGNORED = frozenset(
    {
        "store",
        "metadata",
        "service_tier",
        # OpenAI's caching and abuse-tracking hints (the openai SDK and agent frameworks send
        # them; vLLM ignores them): Weir's prefix cache needs no key.
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "parallel_tool_calls",  # in completions
        "include_obfuscation",
        "guided_decoding_backend",  # vLLM's: which library holds the output to its format
    }
)


def _is_neutral(value: Any, neutral: Any) -> bool:
    # JSON's true is not 1, nor false 0.
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def field_errors(title: str, errors: list[tuple[str, Any, str]]) -> ValidationError:
    """A validation error of each ``(field, value, message)``, located at its field (pydantic
    nests it under the model's own location)."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("invalid_value", "{message}", {"message": message}),
                loc=(field,),
                input=value,
            )
            for field, value, message in errors
        ],
    )


class Body(BaseModel):
    """Unknown fields are refused, in one error (``extra="forbid"`` reports each: a body of a
    million unknown keys would cost seconds of the event loop to list)."""

    model_config = ConfigDict(extra="forbid")
    _ACCEPTED: ClassVar[frozenset[str]] = frozenset()  # names taken besides the fields

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and (unknown := data.keys() - cls.model_fields - cls._ACCEPTED):
            first = next(name for name in data if name in unknown)  # in the body's order
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise field_errors(cls.__name__, [(first, data[first], f"unsupported field{more}")])
        return data


class Options(Body):
    """A body of options, as clients send them: null is a field's default, and the fields of
    ``_NEUTRAL`` and ``_IGNORED`` are dropped (a non-neutral value is refused)."""

    _NEUTRAL: ClassVar[dict[str, Any]] = _NEUTRAL
    _IGNORED: ClassVar[frozenset[str]] = _IGNORED
    _ACCEPTED = frozenset(_NEUTRAL) | _IGNORED

    @model_validator(mode="before")
    @classmethod
    def _drop_defaults_and_neutral_values(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields, kept, refused = cls.model_fields, {}, []
        for name, value in data.items():
            field = fields.get(name)
            if field is not None:
                if (
                    value is not None
                    or field.is_required()
                    or type(None) in get_args(field.annotation)
                ):
                    kept[name] = value
            elif name in cls._NEUTRAL:
                neutral = cls._NEUTRAL[name]
                if value is not None and not _is_neutral(value, neutral):
                    refused.append((name, value, f"only {json.dumps(neutral)} is supported"))
            elif name not in cls._IGNORED:
                return data  # an unknown field, which ``_refuse_unknown_fields`` names
        if refused:
            raise field_errors(cls.__name__, refused)
        return kept


class StreamOptions(Options):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk of text carries its choice's usage so far.
    continuous_usage_stats: bool = False

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(Body):
    _ACCEPTED = frozenset({"schema"})  # schema_'s name in JSON (pydantic's own attribute)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class TagStructure(Body):
    """A structure of a structural tag's first form: what begins it, the JSON schema of
    what it holds, what ends it."""

    _ACCEPTED = frozenset({"schema"})

    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(Body):
    """OpenAI's: free text, any JSON object, or JSON that follows a schema; and vLLM's
    structural tag, in its first form (``structures`` opened by ``triggers``) or
    xgrammar's (a ``format``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> ResponseFormat:
        tagged = self.type == "structural_tag"
        first_form = self.structures is not None or self.triggers is not None
        for name, given, wanted, rule in (
            (
                "json_schema",
                self.json_schema is not None,
                self.type == "json_schema",
                'given with, and only with, type "json_schema"',
            ),
            (
                "format",
                self.format is not None,
                tagged and not first_form,
                'given with type "structural_tag", without structures and triggers',
            ),
            (
                "structures",
                self.structures is not None,
                tagged and self.format is None,
                'given with type "structural_tag" and triggers, or format',
            ),
            (
                "triggers",
                self.triggers is not None,
                tagged and self.format is None,
                'given with type "structural_tag" and structures, or format',
            ),
        ):
            if given != wanted:
                raise field_errors(type(self).__name__, [(name, None, rule)])
        return self

    def structured_output(self) -> dict[str, Any] | None:
        """What it asks for, as ``SamplingParams.structured_output`` takes it."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is not None:
            return {"json": self.json_schema.schema_}
        if self.format is not None:
            return {"structural_tag": {"type": "structural_tag", "format": self.format}}
        if self.structures is not None:
            structures = [
                {"begin": s.begin, "schema": s.schema_ or {}, "end": s.end} for s in self.structures
            ]
            return {"structural_tag": {"structures": structures, "triggers": self.triggers}}
        return None


# Fields that shape sampled outputs, which a beam search (ranking, not sampling) refuses
# (top_p, top_k, min_p and seed pick nothing there and are left as they come, as in vLLM).
_NOT_WITH_BEAM_SEARCH = (
    "stop",
    "stop_token_ids",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "tools",
    "tool_choice",
)


class _SamplingFields(Options):
    """The fields both endpoints share."""

    model: str | None = None
    # vLLM's: the response's id (after its "cmpl-"/"chatcmpl-"); an X-Request-Id header wins.
    request_id: str | None = None
    n: Annotated[int, Field(ge=1)] = 1  # prompts x n at most MAX_CHOICES (OpenAI's 128)
    # None: the server's default (the model's generation_config.json, else Weir's).
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # vLLM's int64
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: (
        Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])]
        | None
    ) = None
    logit_bias: LogitBias | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: Annotated[list[str], Field(fail_fast=True)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(fail_fast=True)] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: lower first, on an engine started with --policy priority.
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    # vLLM's beam search: the n best of n beams (``weir.shared.beam_search``), ranked by
    # cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    # vLLM's: each prompt token's logprob, rank and the n likeliest tokens in its place.
    prompt_logprobs: Logprobs | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_come_whole(self) -> _SamplingFields:
        if self.prompt_logprobs is not None and (self.stream or getattr(self, "echo", False)):
            raise field_errors(
                type(self).__name__,
                [
                    (
                        "prompt_logprobs",
                        self.prompt_logprobs,
                        "comes in a whole response (vLLM's rule), without echo (Weir's: "
                        "echo's logprobs are the prompt's already); drop stream and echo, or "
                        "this field",
                    )
                ],
            )
        return self

    @model_validator(mode="after")
    def _beam_search_takes_no_sampling_rules(self) -> _SamplingFields:
        if not self.use_beam_search:
            return self
        if self.n > MAX_BEAM_WIDTH:
            raise field_errors(
                type(self).__name__,
                [("n", self.n, f"use_beam_search keeps at most {MAX_BEAM_WIDTH} beams")],
            )
        given = [
            name
            for name in _NOT_WITH_BEAM_SEARCH
            if name in self.model_fields_set
            and getattr(self, name) != type(self).model_fields[name].default
        ]
        if given:
            raise field_errors(
                type(self).__name__,
                [
                    (
                        name,
                        None,
                        "is not taken with use_beam_search (beams are ranked by "
                        "logprob, cut by max_tokens and the end-of-sequence token only)",
                    )
                    for name in given
                ],
            )
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise field_errors(
                type(self).__name__,
                [("stream_options", None, "only allowed with stream: true")],
            )
        return self

    @model_validator(mode="after")
    def _reasoning_end_is_the_servers(self) -> _SamplingFields:
        if self.structured_outputs is not None and "reasoning_end" in self.structured_outputs:
            raise field_errors(
                type(self).__name__,
                [("structured_outputs", None, "reasoning_end is set by --reasoning-parser")],
            )
        return self

    # vLLM's: the token ids of the output (and prompt) beside the text, and the logprobs'
    # tokens as "token_id:ID".
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt's last k tokens (-1: as many as leave room for one output token).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), AfterValidator(not_zero)] | None = None
    # vLLM's: cached prompt blocks are shared only among requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_LEN)] | None = None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        index: int,
        defaults: dict[str, Any],
        reasoning_end: str | None = None,
    ) -> SamplingParams:
        """The parameters of sample ``index`` of ``n``: with a seed, each sample draws
        from its own (``seed + index``, wrapped into int64) so the ``n`` samples differ yet
        reproduce.
        ``max_tokens=None``: as many as fit after the prompt (the engine knows how many).
        ``defaults``: the server's for fields the request leaves out (``model_info``'s
        ``default_sampling_params``). ``reasoning_end``: the token after which a structured
        output holds (the reasoning before it is free)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        structured_output = self._structured_output()
        if structured_output is not None and reasoning_end is not None:
            structured_output = {**structured_output, "reasoning_end": reasoning_end}
        return SamplingParams(
            **with_defaults(
                defaults,
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
            ),
            seed=sample_seed(self.seed, index),
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_output=structured_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=(
                None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
            ),
            bad_words=tuple(self.bad_words or ()),
        )

    def _structured_output(self) -> dict[str, Any] | None:
        """The one structured output asked for, as ``SamplingParams`` takes it. A
        ``structured_outputs`` of options alone (``disable_any_whitespace``...) shapes the
        format another field asks for, as vLLM sets ``response_format``'s into them: how a
        client of ``response_format`` (the openai SDK's ``parse``, langchain's
        ``with_structured_output``) stops a weak model writing whitespace until max_tokens."""
        asked = self._structured_outputs_asked()
        # A null key is unset, as SamplingParams reads it.
        options = {k: v for k, v in asked.get("structured_outputs", {}).items() if v is not None}
        if (
            len(asked) > 1
            and "structured_outputs" in asked
            and options.keys() <= set(STRUCTURED_OUTPUT_OPTIONS)
        ):
            del asked["structured_outputs"]
            asked = {field: {**spec, **options} for field, spec in asked.items()}
        if len(asked) > 1:
            raise ValueError(f"ask for one structured output, not {' and '.join(asked)}")
        return next(iter(asked.values()), None)

    def _structured_outputs_asked(self) -> dict[str, dict[str, Any]]:
        """Each field that asks for a structured output, and what it asks for."""
        asked: dict[str, dict[str, Any]] = {}
        if self.response_format is not None:
            if (spec := self.response_format.structured_output()) is not None:
                asked["response_format"] = spec
        if self.structured_outputs is not None:
            asked["structured_outputs"] = self.structured_outputs
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                asked[f"guided_{kind}"] = {kind: value}
        return asked


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or a batch (text or token ids)."""

    prompt: Prompt
    # 0 only with echo: the prompt alone, no completion (OpenAI's and vLLM's way of scoring
    # a prompt's logprobs).
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Logprobs | None = None
    # The prompt before the completion in each choice's text (and its tokens' logprobs,
    # the first null, before the completion's).
    echo: bool = False

    @model_validator(mode="after")
    def _generates_or_echoes(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            message = "max_tokens must be at least 1 (0 only with echo: the prompt alone)"
            raise field_errors(type(self).__name__, [("max_tokens", 0, message)])
        return self

    @property
    def echo_only(self) -> bool:
        """The prompt alone is the answer: one token is generated (the engine's prompt
        logprobs come with a step) and dropped."""
        return self.max_tokens == 0

    def prompt_params(self, params: SamplingParams, prompt: str | list[int]) -> SamplingParams:
        """``params`` with the prompt logprobs echo needs: the rows asked for, or, for a
        prompt of token ids, its tokens' text (the gateway has no tokenizer)."""
        if not self.echo or (self.logprobs is None and isinstance(prompt, str)):
            return params
        return dataclasses.replace(params, prompt_logprobs=self.logprobs or 0)

    def prompts(self) -> list[str | list[int]]:
        return prompt_list("prompt", self.prompt)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageUrl(Body):
    url: str  # a data: URL (the image itself, base64)
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the processor decides


class ImageUrlPart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


Content = Annotated[
    Annotated[str, Tag("string")]
    | Annotated[
        list[Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]],
        Tag("list"),
        Field(fail_fast=True),
    ],
    _string_or_list("text and image_url parts"),
]


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallMessage(Body):
    """A call an assistant message made (sent back with the chat that follows it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_prompt(self) -> dict[str, Any]:
        call: dict[str, Any] = {"type": self.type, "function": self.function.model_dump()}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(Options):
    """A chat message as clients send it back: the openai SDK's whole message (its nulls),
    litellm's too (its provider_specific_fields, a copy of what the response held)."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": [],
    }
    _IGNORED: ClassVar[frozenset[str]] = frozenset({"provider_specific_fields"})
    _ACCEPTED = frozenset(_NEUTRAL) | _IGNORED

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # null only in an assistant message (OpenAI's, whose tool calls may stand for its text).
    content: Content | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallMessage], Field(fail_fast=True)] | None = None
    tool_call_id: str | None = None  # a tool message's: the call it answers
    # An assistant's reasoning, as a reasoning parser returned it (vLLM's newer name, and
    # DeepSeek's older one); templates that render it read ``reasoning_content``.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        problem = None
        reasoning = "reasoning" if self.reasoning is not None else "reasoning_content"
        if self.content is None and self.role != "assistant":
            problem = ("content", f"a {self.role} message needs a string or text parts")
        elif self.tool_calls is not None and self.role != "assistant":
            problem = ("tool_calls", "only an assistant message makes tool calls")
        elif self.tool_call_id is not None and self.role != "tool":
            problem = ("tool_call_id", "only a tool message answers a tool call")
        elif self.reasoning_text() is not None and self.role != "assistant":
            problem = (reasoning, "only an assistant message has reasoning")
        if problem is not None:
            raise field_errors(type(self).__name__, [(problem[0], None, problem[1])])
        return self

    def reasoning_text(self) -> str | None:
        # transformers' choice, where both are given: the name templates read.
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # As vLLM joins them: the parts' words do not run together.
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def content_for_prompt(self) -> str | list[dict[str, Any]]:
        """Its text, or where it holds images its parts as OpenAI's (the client takes the
        images out)."""
        if isinstance(self.content, list) and any(
            isinstance(part, ImageUrlPart) for part in self.content
        ):
            return [part.model_dump(exclude_none=True) for part in self.content]
        return self.text()


def _first_repeated(names: list[str]) -> str | None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceField = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[NamedToolChoice, Tag("named")],
    # One branch's errors, by the value's JSON type (not every branch's, under their tags).
    Discriminator(
        lambda value: (
            "mode" if isinstance(value, str) else "named" if isinstance(value, dict) else None
        ),
        custom_error_type="tool_choice",
        custom_error_message='Input should be "none", "auto", "required" or a named function',
    ),
]


Messages = Annotated[
    list[ChatMessage], Field(min_length=1, fail_fast=True), BeforeValidator(protocol_sized)
]
Tools = Annotated[list[Tool], Field(fail_fast=True), BeforeValidator(protocol_sized)]


def chat_prompt(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the engine's protocol carries them."""
    prompt = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content_for_prompt()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [call.to_prompt() for call in m.tool_calls]
        if (reasoning := m.reasoning_text()) is not None:
            message["reasoning_content"] = reasoning
        prompt.append(message)
    return prompt


class _ChatTemplateFields(Body):
    """vLLM's fields of how the model's template renders a chat."""

    tools: Tools | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables (enable_thinking...)
    # OpenAI's: how long a reasoning model thinks, the template variable gpt-oss' reads (every
    # value vLLM takes: litellm's ``thinking`` asks for "minimal", GPT-5 clients "none").
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # render the last message open, to go on with it

    @model_validator(mode="after")
    def _continue_without_generation_prompt(self) -> _ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise field_errors(
                type(self).__name__,
                [
                    (
                        "continue_final_message",
                        None,
                        "goes on with the last message: it needs add_generation_prompt false",
                    )
                ],
            )
        return self

    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's variables: ``chat_template_kwargs`` and, where a reasoning effort
        is given, ``reasoning_effort`` and, as vLLM sets it, ``enable_thinking`` (Qwen3's
        and GLM's switch): false for "none" (a chat_template_kwargs' own values win)."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is not None:
            effort = {
                "reasoning_effort": self.reasoning_effort,
                "enable_thinking": self.reasoning_effort != "none",
            }
            kwargs = {**effort, **(kwargs or {})}
        return kwargs

    def template_args(self) -> dict[str, Any]:
        """The SDK's arguments of the chat's template."""
        return {
            "tools": tool_prompt(self.tools),
            "chat_template_kwargs": self.template_kwargs(),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


def tool_prompt(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template renders them (OpenAI's form, nulls left out)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True, by_alias=True) for tool in tools]


def _asked_not_to_think(parser: str, kwargs: dict[str, Any]) -> bool:
    """Whether the template's variables ask the model not to think, as ``parser`` reads them
    (vLLM's): Qwen3's and GLM's ``enable_thinking`` false; DeepSeek-V3.1's template thinks
    only given ``thinking`` (or ``enable_thinking``) true, Holo2's unless either is given
    and neither is true."""
    if parser in ("qwen3", "glm45", "glm47"):
        return kwargs.get("enable_thinking") is False
    asked = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    if parser == "deepseek_v3":
        return not asked
    if parser == "holo2":
        given = kwargs.get("thinking") is not None or kwargs.get("enable_thinking") is not None
        return given and not asked
    return False


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """``POST /v1/chat/completions``: the model's chat template renders ``messages``."""

    messages: Messages
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's reasoning out

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_errors(
                type(self).__name__, [("top_logprobs", None, "requires logprobs: true")]
            )
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, [tool.function.name for tool in self.tools or ()]
        if (twice := _first_repeated(names)) is not None:
            raise field_errors(
                type(self).__name__, [("tools", None, f"function {twice!r} is given twice")]
            )
        problem = None
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
            problem = "needs tools"
        elif choice == "auto" and self.tools is None:  # OpenAI's and vLLM's 400
            problem = "'auto' needs tools"
        elif isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            problem = f"names {choice.function.name!r}, which is not among the tools"
        if problem is not None:
            raise field_errors(type(self).__name__, [("tool_choice", None, problem)])
        return self

    def asks_structured_output(self) -> bool:
        return bool(self._structured_outputs_asked())

    def chat_output(
        self,
        parsers: ChatParsers,
        reasoning_end_is_a_token: bool = False,
        response_role: str = "assistant",
    ) -> ChatOutput:
        """How the choices' text is read: its reasoning, if the server reads it, and how it
        holds tool calls (None: content only; so without tools), "auto" read by the
        server's parser (OpenAI's default); the message's role: ``response_role`` where the
        generation prompt is added, else the last message's, as vLLM's. Qwen3 (and GLM,
        DeepSeek-V3.1, Holo2) asked not to think does not (`_asked_not_to_think`), nor a structured output where the model's vocabulary
        has no reasoning end token to hold it to its format after (it is held from its first
        token), nor a continued message (the output goes on with its text): they think only
        where their text opens with the tag."""
        thinking = None
        # Magistral's, Granite's, Hunyuan's and Gemma 4's prompts open no reasoning: the model
        # writes it.
        if parsers.reasoning in ("mistral", "granite", "hunyuan_a13b", "gemma4"):
            thinking = False
        elif parsers.reasoning is not None:
            thinking = (
                (reasoning_end_is_a_token or not self.asks_structured_output())
                and not self.continue_final_message
                and not _asked_not_to_think(parsers.reasoning, self.template_kwargs() or {})
            )
        choice = self.tool_choice or "auto"
        tool_choice = None
        if isinstance(choice, NamedToolChoice):
            tool_choice = ToolChoice("named", choice.function.name)
        elif choice != "none" and self.tools:
            properties = {
                t.function.name: (t.function.parameters or {}).get("properties", {})
                for t in self.tools
            }
            tool_choice = ToolChoice(choice, parser=parsers.tool_call, properties=properties)
        # A harmony model's messages are read whole, but a named or required call's output,
        # which holds to its JSON from the first token.
        harmony = parsers.harmony and (tool_choice is None or tool_choice.kind == "auto")
        return ChatOutput(
            None if harmony else thinking,
            tool_choice,
            self.include_reasoning,
            self.tools is not None,
            harmony,
            markers_of(parsers.reasoning),
            response_role if self.add_generation_prompt else self.messages[-1].role,
        )

    def _structured_outputs_asked(self) -> dict[str, dict[str, Any]]:
        asked = super()._structured_outputs_asked()
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            [function] = [
                t.function for t in self.tools or () if t.function.name == choice.function.name
            ]
            asked["tool_choice"] = {"json": parameters_schema(function.parameters)}
        elif choice == "required":
            tools = [(t.function.name, t.function.parameters) for t in self.tools or ()]
            asked["tool_choice"] = {"json": required_schema(tools, self.parallel_tool_calls)}
        return asked

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class BodyFieldError(ValueError):
    """A field of a body that becomes a chat (the Responses API's, the Messages API's) that
    the chat cannot take."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def chat_of(body: dict[str, Any], fields: Mapping[str, str]) -> ChatCompletionRequest:
    """The chat request of ``body``; ``BodyFieldError`` names the field at fault as the
    client's body does (``fields``: a chat field's name there, where it differs)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = str(error["loc"][0]) if error["loc"] else "messages"
        raise BodyFieldError(fields.get(where, where), error["msg"]) from None


class TokenizeBody(_ChatTemplateFields):
    """vLLM's ``POST /tokenize``: a text ``prompt`` or chat ``messages`` (with the chat's
    template fields), tokenized as a completion's or chat's prompt is
    (``add_special_tokens``: by default a text's yes, a chat's no, since its template
    writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise field_errors(
                type(self).__name__, [("prompt", None, "send a prompt or messages, not both")]
            )
        if self.messages is None and (
            given := next(
                (name for name in ("tools", "chat_template_kwargs") if getattr(self, name)),
                "continue_final_message" if self.continue_final_message else None,
            )
        ):
            raise field_errors(type(self).__name__, [(given, None, "only with messages")])
        return self


class DetokenizeBody(Body):
    """vLLM's ``POST /detokenize``: the text of token ids (special tokens included)."""

    model: str | None = None
    tokens: Annotated[TokenIds, BeforeValidator(protocol_sized)]


class UpdateWeightsBody(Body):
    """SGLang's ``POST /update_weights_from_disk``: serve the weights of the model directory
    at ``model_path`` (on the engine's machines; the served model's architecture)."""

    model_path: str = Field(min_length=1, max_length=4096)
    load_format: Literal["auto"] | None = None


class LoadLoraAdapterBody(Body):
    """vLLM's ``POST /v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` (on the
    engine's machines) as ``lora_name``."""

    lora_name: str
    lora_path: str
    # vLLM's reload of a loaded adapter in place; here: unload it, then load it again.
    load_inplace: Literal[False] = False


class UnloadLoraAdapterBody(Body):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: None = None  # vLLM's internal id: adapters are named here
