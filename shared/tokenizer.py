"""The model's tokenizer and chat template, without transformers, plus streaming detokenization.

`Tokenizer` reads a Hugging Face model directory (tokenizer.json, tokenizer_config.json; its
stop tokens are `weir.shared.model_config.eos_token_ids`, the ones the executor bans before
min_tokens), or another directory's tokenizer for the model (``--tokenizer``,
`served_tokenizer`), and renders the chat template the way transformers does.
`IncrementalDetokenizer` turns streamed token ids into text deltas for the scheduler's hot loop.
"""

import json
import logging
import os
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from weir.shared.model_config import eos_token_ids, read_json

logger = logging.getLogger(__name__)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON, as in transformers.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's text for
    training (TRL's assistant-only loss): rendered as its body, as transformers renders it
    when no one asks for the marks."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers' `apply_chat_template` uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlocks]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def chat_template_of(option: str | None) -> str | None:
    """The template a ``--chat-template`` option gives: a file's text, or the option's own
    text when it is a template (as vLLM reads it); ValueError for a file that is not there."""
    if option is None:
        return None
    if any(mark in option for mark in ("{{", "{%")):
        return option
    try:
        return Path(option).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"--chat-template {option!r}: neither a readable template file nor a Jinja "
            f"template ({exc})"
        ) from None


def _token_content(value: str | dict[str, Any] | None, path: Path | None = None) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as a serialized AddedToken.
    content = value.get("content") if isinstance(value, dict) else value
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{path}: a special token must be a string, got {value!r}")
    return content


def _config_templates(value: Any, path: Path) -> tuple[str | None, str | None]:
    """tokenizer_config.json's ``chat_template``: one template, or transformers' named ones
    (a list of ``{"name", "template"}``, as Command-R's and Hermes' tokenizers save them), of
    which a chat is rendered by "default" and one with tools by "tool_use" where there is
    one, as transformers (and so vLLM) choose. Returns (default, tool_use)."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default"), named.get("tool_use")
    raise ValueError(
        f"{path}: chat_template must be a template or a list of named templates "
        f'({{"name": ..., "template": ...}}), got {type(value).__name__}'
    )


class _WholePieces(dict[int, str | None]):
    """Token id -> the text it adds after any text that ends on a whole character, or None
    where that depends on its neighbours. Filled as ids are first seen.

    A byte-level BPE decoder (GPT-2, Llama 3, Qwen, SmolLM) decodes a sequence as the UTF-8
    of its tokens' bytes laid end to end, so a token whose bytes are whole UTF-8 on their own
    always adds its own text. Not so for a part of a character, an added token (special
    tokens may be skipped), or another decoder (SentencePiece's drops a leading space)."""

    def __init__(self, backend: BackendTokenizer) -> None:
        super().__init__()
        self._backend = backend
        self._byte_level = isinstance(backend.decoder, ByteLevel)
        self._added_ids = frozenset(backend.get_added_tokens_decoder())

    def __missing__(self, token_id: int) -> str | None:
        piece = None
        backend = self._backend
        if (
            self._byte_level
            and token_id not in self._added_ids
            and backend.id_to_token(token_id) is not None
        ):
            text = backend.decode([token_id], skip_special_tokens=False)
            if "\ufffd" not in text:
                piece = text
        self[token_id] = piece
        return piece


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's special tokens, stop tokens and chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
        tool_chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        eos_ids = () if self.eos_token_id is None else (self.eos_token_id,)
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys((*eos_ids, *extra_stop_token_ids))
        )
        try:
            self._chat_template = (
                None if chat_template is None else compile_chat_template(chat_template)
            )
            # A named "tool_use" template (see _config_templates): a chat with tools's.
            self._tool_chat_template = (
                None if tool_chat_template is None else compile_chat_template(tool_chat_template)
            )
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template is not valid Jinja: {exc}") from None
        self.whole_pieces = _WholePieces(backend)
        self._truncating: BackendTokenizer | None = None
        self._truncating_lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls,
        path: str | os.PathLike[str],
        chat_template: str | None = None,
        tokenizer_dir: str | os.PathLike[str] | None = None,
    ) -> "Tokenizer":
        """The model directory's tokenizer, with ``chat_template`` (its text) in place of the
        model's, if given. With ``tokenizer_dir`` (``--tokenizer``), that directory's
        tokenizer, special tokens and chat template instead, as vLLM takes them; the model's
        config.json and generation_config.json still add their end tokens."""
        model_dir = Path(path)
        source = model_dir if tokenizer_dir is None else Path(tokenizer_dir)
        config_path = source / "tokenizer_config.json"
        config = read_json(config_path)
        # Before tokenizer.json is loaded: a malformed config file is named even without it.
        eos_ids = eos_token_ids(model_dir, tokenizer_dir)
        bos_token = _token_content(config.get("bos_token"), config_path)
        eos_token = _token_content(config.get("eos_token"), config_path)
        tool_chat_template = None
        # chat_template.jinja before tokenizer_config.json's, as transformers (and so vLLM)
        # reads them: a repository that updated its template there may keep the old one.
        if chat_template is None and (source / "chat_template.jinja").is_file():
            chat_template = (source / "chat_template.jinja").read_text(encoding="utf-8")
        if chat_template is None:
            chat_template, tool_chat_template = _config_templates(
                config.get("chat_template"), config_path
            )
        if chat_template is None:  # a multimodal model's, where its processor keeps it
            chat_template = read_json(source / "chat_template.json").get("chat_template")
        try:
            backend = BackendTokenizer.from_file(str(source / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{source / 'tokenizer.json'}: cannot be read: {exc}") from None
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=bos_token,
            eos_token=eos_token,
            extra_stop_token_ids=eos_ids,
            tool_chat_template=tool_chat_template,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no token covers more text (the
        entries of byte-level vocabularies hold one character per byte)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL (encode holds it), so a long prompt tokenized on a
        # worker thread leaves the scheduler's event loop running.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, text: str, pair: str, max_length: int | None = None) -> list[int]:
        """Two texts' token ids as the tokenizer's post-processor joins them (a
        cross-encoder's query and document), special tokens included; with ``max_length``,
        cut longest first to that many, as transformers' ``tokenizer(text, pair,
        truncation=True, max_length=...)``."""
        if max_length is None:
            return self.backend.encode_batch([(text, pair)])[0].ids
        # Truncation is a tokenizer's state: a copy of its own, one encoding at a time.
        with self._truncating_lock:
            if self._truncating is None:
                self._truncating = BackendTokenizer.from_str(self.backend.to_str())
            self._truncating.enable_truncation(max_length, strategy="longest_first")
            return self._truncating.encode_batch([(text, pair)])[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat as the model's template renders it, as transformers' does: with ``tools``
        (OpenAI's tool list) for templates that render tools, ``template_kwargs`` as more
        variables (``enable_thinking``...), and with ``continue_final_message`` cut after
        the last message's text, so the model goes on with it. Messages are OpenAI's,
        adapted as transformers' templates expect: "developer" is "system", and a tool
        call's arguments are a map, not JSON text."""
        template = self._chat_template
        if tools and self._tool_chat_template is not None:
            template = self._tool_chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json has no 'chat_template', "
                "or none named 'default'); give one with --chat-template"
            )
        if reserved := sorted((template_kwargs or {}).keys() & _TEMPLATE_ARGUMENTS):
            raise ValueError(
                f"chat_template_kwargs: {reserved[0]!r} is set by the request itself, not as "
                "a template variable"
            )
        chat = [_template_message(m) for m in messages]
        if continue_final_message:  # marked, to cut the rendering after it
            chat[-1] = {**chat[-1], "content": chat[-1].get("content", "") + _CONTINUE_TAG}
        # As transformers: a template variable may stand for a special token. One map, so
        # that no variable's name collides with render's own arguments.
        text = template.render(
            {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
            | (template_kwargs or {})
            | {"messages": chat, "tools": tools, "add_generation_prompt": add_generation_prompt}
        )
        return _cut_at_tag(text, messages[-1]) if continue_final_message else text


def served_tokenizer(
    model_dir: str | os.PathLike[str],
    num_embeddings: int,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    chat_template: str | None = None,
) -> Tokenizer:
    """The tokenizer a model is served with (``Tokenizer.from_model_dir``): with
    ``tokenizer_dir`` (``--tokenizer``), ValueError where that one numbers a token the model
    has no embedding row for (``num_embeddings``: config.json's vocab_size). Fewer tokens
    than rows is usual: embeddings are padded to a multiple of 64 or 128."""
    tokenizer = Tokenizer.from_model_dir(model_dir, chat_template, tokenizer_dir)
    if tokenizer_dir is not None:
        largest = max(tokenizer.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        if largest >= num_embeddings:
            raise ValueError(
                f"tokenizer {str(tokenizer_dir)!r}: its vocabulary numbers tokens up to id "
                f"{largest}, but the model embeds {num_embeddings} (ids 0-{num_embeddings - 1}): "
                "give the tokenizer of this model or of its family"
            )
    return tokenizer


# What a request sets itself; documents: transformers' (RAG), which Weir does not take.
_TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})
# transformers' mark of the end of the message to continue.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str, final: dict[str, Any]) -> str:
    """``text`` up to the end of the final message's content, as transformers continues a
    message: where the mark after it was rendered (without the spaces before it, where the
    template trims them)."""
    tag = _CONTINUE_TAG.strip()
    if final.get("content", "").strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message: the chat template does not render the last message's "
            "text as it is, so it cannot be continued"
        )
    end = text.rindex(tag)
    return (
        text[:end] if text[end : end + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:end].rstrip()
    )


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "developer":
        message = {**message, "role": "system"}
    if "reasoning_content" in message:  # gpt-oss's templates read it as thinking
        message = {"thinking": message["reasoning_content"], **message}
    if message.get("tool_calls"):
        message = {
            **message,
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _arguments(call)}}
                for call in message["tool_calls"]
            ],
        }
    return message


def _arguments(call: dict[str, Any]) -> Any:
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except ValueError:  # a call cut short by max_tokens, sent back as it was: rendered as is
        return text


# Prompt tokens replayed before the first output token, so tokenizers whose decoding of a token
# depends on what precedes it (leading-space handling) decode the first output in context.
_PROMPT_CONTEXT_TOKENS = 6
_INVALID_PREFIX = "Invalid prefix"


class NoText:
    """The detokenizer of a request that asked for none (``detokenize=False``): no text."""

    def add(self, new_token_ids: Sequence[int]) -> str:
        return ""


class IncrementalDetokenizer:
    """Text deltas for streamed token ids, holding back an incomplete UTF-8 character until it completes.

    vLLM's scheme: keep a prefix offset and a read offset into the ids, decode only the window between
    the prefix offset and the end, and emit what it adds to the decoded prefix unless that ends in
    U+FFFD. `tokenizers.decoders.DecodeStream` does exactly this in Rust, on a window of a few tokens.
    While the text so far ends on a whole character, a token with a whole piece
    (``Tokenizer.whole_pieces``) adds that piece without a decode: ~2.5 us less per token,
    most tokens of byte-level vocabularies, on the loop that publishes every stream's step.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend
        self._pieces = tokenizer.whole_pieces
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Whether the text so far ends on a whole character; the first output token decodes
        # in the prompt's context, which may not.
        self._whole = False
        # Characters of the prompt's text that the first output text repeats (see below).
        self._repeated = 0
        prompt_text = (
            self._backend.decode(context, skip_special_tokens=skip_special_tokens)
            if context and self._pieces[context[-1]] is None
            else ""
        )
        if prompt_text.endswith("\ufffd"):
            # A prompt that ends inside a character: given it as its prefix, DecodeStream's
            # first step would return the text of the whole window. Stepped through, as
            # vLLM primes its stream, it holds back the token the character begins in, which
            # the first output text then repeats, less what the output completes.
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            primed = "".join(chunk or "" for chunk in map(self._decode_step, context))
            self._repeated = max(0, len(prompt_text.rstrip("\ufffd")) - len(primed))
        else:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def add(self, new_token_ids: Sequence[int]) -> str:
        if len(new_token_ids) == 1:  # a decode step's one token: no generator, no join
            return self._step(new_token_ids[0]) or ""
        return "".join(
            chunk for token_id in new_token_ids if (chunk := self._step(token_id)) is not None
        )

    def _step(self, token_id: int) -> str | None:
        if self._whole:
            piece = self._pieces[token_id]
            if piece is not None:
                # The stream never sees this token: with byte-level decoding the text of
                # what follows does not depend on whole characters before it.
                return piece
        chunk = self._decode_step(token_id)
        self._whole = chunk is not None
        if chunk is not None and self._repeated:
            chunk, self._repeated = chunk[self._repeated :], 0
        return chunk

    def _decode_step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:
            # A window whose decoding does not extend the previous one (seen with some byte sequences)
            # leaves DecodeStream unable to continue; restart from this token, as vLLM does.
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            logger.debug("detokenizer window reset at token %d", token_id)
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)
