"""weir's Tokenizer and IncrementalDetokenizer against transformers' tokenizers for the default model."""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models
from tokenizers.decoders import DecodeStream

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


def test_the_developer_role_is_the_system_role(ours: Tokenizer, hf_dir) -> None:
    """OpenAI's newer name for the system prompt, the same to every client (the SDK too)."""
    turn = [{"role": "user", "content": "Hi"}]
    expected = hf_dir.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *turn],
        tokenize=False,
        add_generation_prompt=True,
    )
    developer = [{"role": "developer", "content": "Be brief."}, *turn]
    assert ours.apply_chat_template(developer) == expected


def test_generation_blocks_render_as_transformers_renders_them(
    default_model_dir: Path, hf_dir
) -> None:
    """TRL's assistant-only-loss templates mark the assistant's text with ``{% generation
    %}``: rendered as its body (a template with it was refused as not Jinja)."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{% set n = 1 %}{{ m.content }}"
        "<|im_end|>{% endgeneration %}{{ n | default('x') }}\n"
        "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 🎉?"},
    ]
    expected = hf_dir.apply_chat_template(
        chat, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    ours = Tokenizer.from_model_dir(default_model_dir, chat_template=template)
    assert ours.apply_chat_template(chat) == expected and "<|im_end|>x" in expected


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


@pytest.fixture(scope="module")
def partial_ids(ours: Tokenizer) -> list[int]:
    """Ids without a whole piece: parts of characters and the added (special) tokens."""
    return [i for i in range(ours.vocab_size) if ours.whole_pieces[i] is None]


def _decode_stream_alone(ours: Tokenizer, prompt: list[int], ids: list[int]) -> str | None:
    """tokenizers' DecodeStream stepped a token at a time, as the detokenizer did before it
    took whole pieces; None where the stream cannot continue (its window reset)."""
    stream = DecodeStream(ids=prompt[-6:], skip_special_tokens=True)
    try:
        return "".join(stream.step(ours.backend, t) or "" for t in ids)
    except Exception:
        return None


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 3))
def test_whole_pieces_change_no_character(
    ours: Tokenizer, hf_dir, partial_ids: list[int], data: st.DataObject, chunk: int
) -> None:
    """Random ids, about a third of them parts of characters or special tokens: the deltas
    are what DecodeStream gives alone, and what transformers decodes wherever the prompt's
    end and the output are whole text."""
    any_id = st.integers(0, ours.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(any_id, any_id, st.sampled_from(partial_ids)), max_size=24))
    prompt = data.draw(st.lists(any_id, max_size=8))
    detok = IncrementalDetokenizer(ours, prompt)
    text = "".join(detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    before = hf_dir.decode(prompt[-6:], skip_special_tokens=True)
    if before.endswith("\ufffd"):
        # A prompt that ends inside a character: the output's text is what its tokens add
        # to the prompt's whole text (the character they complete, not the prompt's end).
        both = hf_dir.decode(prompt[-6:] + ids, skip_special_tokens=True)
        clean = before.rstrip("\ufffd")
        if both.startswith(clean) and "\ufffd" not in both[len(clean) :]:
            assert text == both[len(clean) :]
    elif (alone := _decode_stream_alone(ours, prompt, ids)) is not None:
        assert text == alone
    full = hf_dir.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in full + hf_dir.decode(prompt[-6:]):
        assert text == full


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_prompt_that_ends_inside_a_character_is_not_repeated_in_the_output(
    ours: Tokenizer, hf_dir, skip_special_tokens: bool
) -> None:
    """Token-id prompts cut anywhere: the output's text is what transformers decodes of
    prompt and output together past the prompt's whole text (its first step returned the
    prompt's last tokens' text too, where the prompt ended inside a character)."""
    ids = ours.encode("The Japanese word for Japan is 日本 😀 <|im_end|> テキスト 🎉 ok")
    inside = 0
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip_special_tokens)
        text = "".join(detok.add([t]) for t in out)
        before = hf_dir.decode(prompt, skip_special_tokens=skip_special_tokens)
        inside += before.endswith("\ufffd")
        clean = before.rstrip("\ufffd")
        whole = hf_dir.decode(ids, skip_special_tokens=skip_special_tokens)
        assert whole.startswith(clean) and text == whole[len(clean) :], cut
    assert inside >= 5


def test_common_tokens_have_whole_pieces(ours: Tokenizer, partial_ids: list[int]) -> None:
    """Most of a byte-level vocabulary adds its own text; parts of characters and special
    tokens do not."""
    assert len(partial_ids) < 0.05 * ours.vocab_size
    assert ours.whole_pieces[ours.encode(" hello")[0]] == " hello"
    assert ours.eos_token_id in partial_ids
    assert set(ours.encode(" 🎉")) <= set(partial_ids)  # four bytes over several tokens


def test_a_decoder_that_is_not_byte_level_has_no_whole_pieces() -> None:
    """SentencePiece's decoder drops the first token's leading space: a token's text
    depends on its place, so every token goes through DecodeStream."""
    backend = BackendTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, "<unk>"))
    backend.decoder = decoders.Metaspace()
    ours = Tokenizer(backend)
    assert ours.whole_pieces[0] is None and ours.whole_pieces[1] is None
    assert IncrementalDetokenizer(ours, []).add([0, 1, 0]) == "Hello world Hello"


def test_a_multimodal_model_s_chat_template_json_is_its_template(
    ours: Tokenizer, hf_dir, default_model_dir: Path, tmp_path: Path
) -> None:
    """Qwen-VL's and Mistral 3's repositories keep the template in chat_template.json, as
    their processors read it, not in tokenizer_config.json."""
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path)
    messages = [{"role": "user", "content": "Hi"}]
    want = hf_dir.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert Tokenizer.from_model_dir(tmp_path).apply_chat_template(messages) == want


def test_a_chat_template_jinja_wins_over_tokenizer_config_s_as_in_transformers(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """transformers reads chat_template.jinja over tokenizer_config.json's chat_template (a
    repository that updated its template there may keep the old one); Weir rendered the
    old one."""
    transformers = pytest.importorskip("transformers")
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path)
    config = {"eos_token": "<|im_end|>", "chat_template": "old:{{ messages[0]['content'] }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("new:{{ messages[0]['content'] }}")
    messages = [{"role": "user", "content": "Hi"}]
    want = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, tokenize=False
    )
    assert want == "new:Hi"
    assert Tokenizer.from_model_dir(tmp_path).apply_chat_template(messages) == want
