"""weir's Tokenizer and IncrementalDetokenizer against transformers' tokenizers for the default model."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.shared.model_store import default_gguf_path
from weir.shared.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "café déjà vu é",
    "中文测试，你好世界",
    "emoji 🎉🚀 and a family 👨‍👩‍👧‍👦",
    "Привет, мир! Ёжик",
    "tabs\tand  double   spaces\n\n\nnewlines   ",
    " leading space and trailing ",
    "digits 0 12 345 6789 3.14159 x1y22",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll WE'RE they've",
    "def f(x):\n    return x ** 2  # comment",
    "\u00a0non-breaking\u2009thin space",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi! Can you say é and 中文?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 🎉 times two?"},
    ],
]


@pytest.fixture(scope="module")
def ours(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_dir(default_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def hf_gguf():
    """The tokenizer transformers rebuilds from the original GGUF metadata, independently of our converter."""
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(text: str, ours: Tokenizer, hf_dir, hf_gguf) -> None:
    ids = ours.encode(text)
    assert ids == hf_dir.encode(text, add_special_tokens=False)
    assert ids == hf_gguf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf_dir.encode(
        text, add_special_tokens=True
    )


def test_chatml_tags_are_single_special_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.bos_token_id == 1
    assert ids[-1] == ours.eos_token_id == 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_whitespace_before_digits_follows_llama_cpp_smollm_rule(ours: Tokenizer, hf_dir) -> None:
    # llama.cpp's "smollm" pre-tokenizer (like the original HF tokenizer) isolates every digit
    # before applying the GPT-2 regex, so a run of spaces before a digit stays one piece ("ĠĠ").
    # transformers' GGUF loader applies the GPT-2 regex alone here and splits it into "Ġ", "Ġ".
    expected = hf_dir.convert_tokens_to_ids(["a", "ĠĠ", "1", "2", "3"])
    assert ours.encode("a  123") == expected


def test_special_token_ids_and_vocab_size_match_transformers(ours: Tokenizer, hf_dir) -> None:
    assert ours.bos_token_id == hf_dir.bos_token_id
    assert ours.eos_token_id == hf_dir.eos_token_id
    assert ours.vocab_size == len(hf_dir) == 49152
    assert ours.eos_token_id in ours.stop_token_ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    messages, add_generation_prompt: bool, ours: Tokenizer, hf_dir
) -> None:
    expected = hf_dir.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip_matches_transformers(text: str, ours: Tokenizer, hf_dir) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf_dir.decode(ids, skip_special_tokens=True)


def _stream(
    ours: Tokenizer, prompt: str, ids: list[int], chunk: int, skip_special_tokens: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(
        ours, ours.encode(prompt), skip_special_tokens=skip_special_tokens
    )
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(
    "text", [t for t in TEXTS if not t.isascii()] + ["🎉" * 5 + "中" * 5 + "👍🏽 ok"]
)
def test_incremental_deltas_concatenate_to_full_decode(
    text: str, chunk: int, ours: Tokenizer, hf_dir
) -> None:
    ids = ours.encode(text)
    deltas = _stream(ours, "Prompt: é🎉", ids, chunk)
    assert "".join(deltas) == hf_dir.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)


def test_split_character_is_held_until_complete(ours: Tokenizer) -> None:
    ids = ours.encode(" 🎉")
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    assert _stream(ours, "x", ids, 1) == [""] * (len(ids) - 1) + [" 🎉"]


def test_incremental_keeps_special_tokens_when_asked(ours: Tokenizer) -> None:
    ids = ours.encode("Sure.<|im_end|>")
    assert "".join(_stream(ours, "hi", ids, 1, skip_special_tokens=False)) == "Sure.<|im_end|>"
    assert "".join(_stream(ours, "hi", ids, 1)) == "Sure."


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=st.sampled_from("ab Z09 \n.,é中文🎉👍🏽Жж\u200d"), max_size=40),
    st.integers(1, 4),
)
def test_incremental_property(ours: Tokenizer, text: str, chunk: int) -> None:
    ids = ours.encode(text)
    deltas = _stream(ours, "", ids, chunk)
    assert "".join(deltas) == ours.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
