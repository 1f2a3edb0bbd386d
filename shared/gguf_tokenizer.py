"""The tokenizer a GGUF file states, rebuilt as its original tokenizer.json's `tokenizers` pipeline.

Two of llama.cpp's kinds (``tokenizer.ggml.model``) convert:

- ``gpt2``: byte-level BPE with the file's merges, cut first as ``tokenizer.ggml.pre`` names
  (GPT-2's; StarCoder's, SmolLM's, Granite's and Cohere's digits; Llama 3's and GLM-4's;
  Qwen's; Mistral's Tekken; o200k's).
- ``llama``: SentencePiece BPE (Llama 1 and 2, Mistral 7B's first three, Gemma, Phi-3, Yi, ...)
  as the original tokenizer.json holds it, and so as sentencepiece encodes each stretch of
  text between added tokens: spaces spelled "▁", one more prepended unless the file's
  ``add_space_prefix`` is false (Gemma's), bytes for characters the vocabulary lacks. The
  merges the file leaves out are recovered from its vocabulary as transformers' GGUF loader
  recovers them: every split of a piece into two pieces, ranked by the piece's score
  (sentencepiece's own order of merging), or for Gemma by its place in the file (Gemma's
  scores do not follow its merges); Gemma's pieces of spaces, stored as spaces, are spelled
  "▁" again. (transformers' loader, vLLM's tokenizer for such a file, cuts the text as
  Llama's non-legacy tokenizer does instead: no "▁" prepended to text that begins with a
  space or follows an added token.)

Anything else raises `UnsupportedGGUFError` naming it and telling to serve the file with its
original tokenizer (``--tokenizer DIR``), vLLM's advice.
"""

from dataclasses import dataclass
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from weir.shared.gguf_metadata import GGUFMetadata, UnsupportedGGUFError

# What an unsupported tokenizer's error adds: vLLM's way round it.
GIVE_TOKENIZER = (
    "; serve the file with its original Hugging Face tokenizer instead: --tokenizer DIR "
    "(a directory with its tokenizer.json and tokenizer_config.json)"
)
# llama.cpp's token types (tokenizer.ggml.token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_SPACE = "\u2581"  # SentencePiece's spelling of a space
# Architectures whose SentencePiece files llama.cpp writes otherwise than Llama's.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Nemo, Small 3, Ministral): words split at a case change, single digits.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss, Llama 4, MiniMax-M2): Tekken's words with their contractions, 1-3 digits.
_O200K_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _O200K_CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _O200K_CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(slots=True, frozen=True)
class _Pretokenization:
    """How the original HF tokenizer cut text before BPE; llama.cpp names it in `tokenizer.ggml.pre`."""

    pre_tokenizer: pre_tokenizers.PreTokenizer
    normalizer: normalizers.Normalizer | None = None
    ignore_merges: bool = False


# llama.cpp's names of the pre-tokenizers (tokenizer.ggml.pre) that cut text alike.
_GPT2_NAMES = ("gpt2", "default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion")
# StarCoder's, SmolLM's, Granite 3's, Cohere's, EXAONE's: digits one by one, then GPT-2's cuts.
_DIGITS_NAMES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral")
# GLM-4's cuts are Llama 3's; its tokenizer.json does not skip the merges of whole words.
_GLM4_NAMES = ("glm4", "chatglm-bpe")
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen")
_O200K_NAMES = ("gpt-4o", "llama4", "minimax-m2")


def _pretokenization(pre: str) -> _Pretokenization:
    if pre in _GPT2_NAMES:
        return _Pretokenization(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    if pre in _DIGITS_NAMES:
        # StarCoder-family vocabularies were trained on single digits; HF splits them before the GPT-2 regex.
        return _Pretokenization(
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        )
    if pre in _LLAMA3_NAMES:
        return _Pretokenization(_split_then_bytes(_LLAMA3_SPLIT), ignore_merges=True)
    if pre in _GLM4_NAMES:
        return _Pretokenization(_split_then_bytes(_LLAMA3_SPLIT))
    if pre in _QWEN2_NAMES:
        return _Pretokenization(_split_then_bytes(_QWEN2_SPLIT), normalizer=normalizers.NFC())
    if pre == "tekken":
        return _Pretokenization(_split_then_bytes(_TEKKEN_SPLIT))
    if pre in _O200K_NAMES:
        return _Pretokenization(_split_then_bytes(_O200K_SPLIT))
    known = (
        *_GPT2_NAMES,
        *_DIGITS_NAMES,
        *_LLAMA3_NAMES,
        *_GLM4_NAMES,
        *_QWEN2_NAMES,
        "tekken",
        *_O200K_NAMES,
    )
    raise UnsupportedGGUFError(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: "
        f"{', '.join(known)}){GIVE_TOKENIZER}"
    )


def special_token_ids(meta: GGUFMetadata) -> dict[str, int]:
    """bos/eos/pad ids under their Hugging Face config names, for those the file states."""
    names = {
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "pad_token_id": "padding_token_id",
    }
    ids = {name: meta.get(f"tokenizer.ggml.{meta_key}") for name, meta_key in names.items()}
    return {name: int(value) for name, value in ids.items() if value is not None}


def build_tokenizer(meta: GGUFMetadata, arch_name: str) -> Tokenizer:
    """A `tokenizers` tokenizer equal to the model's original tokenizer.json."""
    kind = meta.require("tokenizer.ggml.model")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level(meta, tokens)
    elif kind == "llama":
        tokens = _sentencepiece_spelling(tokens, arch_name)
        tokenizer = _sentencepiece(meta, tokens, arch_name)
    else:
        raise UnsupportedGGUFError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level "
            f"BPE, 'llama' SentencePiece BPE){GIVE_TOKENIZER}"
        )
    tokenizer.post_processor = _post_processor(meta, tokens, byte_level=kind == "gpt2")
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == _TOKEN_USER_DEFINED
        ]
    )
    return tokenizer


def _byte_level(meta: GGUFMetadata, tokens: list[str]) -> Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    pretokenization = _pretokenization(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            ignore_merges=pretokenization.ignore_merges,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = pretokenization.normalizer
    tokenizer.pre_tokenizer = pretokenization.pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_spelling(tokens: list[str], arch_name: str) -> list[str]:
    """The pieces as SentencePiece spells them: llama.cpp stores Gemma's pieces of spaces
    (user-defined in its vocabulary) as spaces."""
    if arch_name not in _GEMMA_ARCHITECTURES:
        return tokens
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _sentencepiece(meta: GGUFMetadata, tokens: list[str], arch_name: str) -> Tokenizer:
    stated = meta.get("tokenizer.ggml.merges")
    if stated is not None:
        merges = [tuple(merge.split(" ", 1)) for merge in stated]
    elif arch_name in _GEMMA_ARCHITECTURES:
        merges = _recovered_merges(tokens, [-float(i) for i in range(len(tokens))])
    else:
        merges = _recovered_merges(tokens, meta.require("tokenizer.ggml.scores"))
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            unk_token=_special_token(meta, tokens, "unknown_token_id"),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # The original tokenizer.json's pipeline (Llama 2's, Mistral's, Phi-3's, Gemma's): each
    # stretch of text between added tokens spelled with "▁" for spaces, after one more unless
    # the file says not to (Gemma's), as sentencepiece encodes a text.
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    replace = normalizers.Replace(" ", _SPACE)
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.normalizer = replace
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _recovered_merges(tokens: list[str], ranks: list[float]) -> list[tuple[str, str]]:
    """The merges that build each piece from two pieces, in transformers' order: by the
    piece's rank, then the longer left part, then the longer right part, then the file's order."""
    vocab = set(tokens)
    ranked = dict(zip(tokens, ranks))
    splits = [
        (-rank, -cut, cut - len(token), order, token[:cut], token[cut:])
        for order, (token, rank) in enumerate(ranked.items())
        for cut in range(len(token) - 1, 0, -1)
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    splits.sort()
    return [(left, right) for *_, left, right in splits]


def _special_token(meta: GGUFMetadata, tokens: list[str], key: str) -> str | None:
    """The token the file names by id under ``tokenizer.ggml.{key}`` (None where it names
    none); an id outside the vocabulary is a damaged file, said by name."""
    index = meta.get(f"tokenizer.ggml.{key}")
    if index is None:
        return None
    if not 0 <= int(index) < len(tokens):
        raise UnsupportedGGUFError(
            f"GGUF tokenizer.ggml.{key} {int(index)} is outside its {len(tokens)} tokens: "
            "the file is damaged"
        )
    return tokens[int(index)]


def _adds_bos(meta: GGUFMetadata) -> bool:
    # llama.cpp and transformers add a SentencePiece vocabulary's BOS where the file does not say.
    return bool(
        meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    )


def _post_processor(
    meta: GGUFMetadata, tokens: list[str], *, byte_level: bool
) -> processors.PostProcessor | None:
    """Adds the BOS and EOS the file asks for."""

    def special(wanted: bool, key: str) -> tuple[str, int] | None:
        token = _special_token(meta, tokens, key) if wanted else None
        return None if token is None else (token, int(meta.require(f"tokenizer.ggml.{key}")))

    bos = special(_adds_bos(meta), "bos_token_id")
    eos = special(bool(meta.get("tokenizer.ggml.add_eos_token", False)), "eos_token_id")
    steps: list[processors.PostProcessor] = []
    if byte_level:
        steps.append(processors.ByteLevel(trim_offsets=False))
    if bos is not None or eos is not None:

        def framed(sequence: str) -> str:
            return " ".join(t for t in (bos and bos[0], sequence, eos and eos[0]) if t)

        steps.append(
            processors.TemplateProcessing(
                single=framed("$A"),
                pair=f"{framed('$A')} {framed('$B')}",
                special_tokens=[s for s in dict.fromkeys((bos, eos)) if s is not None],
            )
        )
    if len(steps) < 2:
        return steps[0] if steps else None
    return processors.Sequence(steps)


def tokenizer_config(meta: GGUFMetadata, context_length: int) -> dict[str, Any]:
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _special_token(meta, tokens, "bos_token_id"),
        "eos_token": _special_token(meta, tokens, "eos_token_id"),
        "unk_token": _special_token(meta, tokens, "unknown_token_id"),
        "pad_token": _special_token(meta, tokens, "padding_token_id"),
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": [
            t for t, kind in zip(tokens, token_types) if kind == _TOKEN_CONTROL
        ],
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def generation_config(meta: GGUFMetadata) -> dict[str, Any]:
    stop_ids: list[int] = []
    # End-of-turn / end-of-message tokens also stop a chat turn (llama.cpp keeps them apart from eos).
    for meta_key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{meta_key}")
        if value is not None and int(value) not in stop_ids:
            stop_ids.append(int(value))
    return special_token_ids(meta) | {
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else stop_ids
    }
