"""Fixtures for the process-level tests: a tiny random Llama that speaks SmolLM2's tokenizer."""

import shutil
from pathlib import Path

import pytest
import torch
from spread_weights import spread_weights_

transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def save_tiny_llama(path: Path, tokenizer_dir: Path, num_layers: int = 2) -> None:
    """A random Llama (2 layers unless told) with SmolLM2's vocabulary, so text prompts and chat work."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    save_speaking(transformers.LlamaForCausalLM(config).eval(), path, tokenizer_dir)


def save_speaking(model, path: Path, tokenizer_dir: Path) -> None:
    """``model`` with spread random weights, saved with ``tokenizer_dir``'s tokenizer."""
    spread_weights_(model)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)


def save_with_markers(path: Path, tokenizer_dir: Path, markers: list[str]) -> dict[str, int]:
    """A tiny random Llama with ``tokenizer_dir``'s tokenizer and ``markers`` added as special
    tokens (a format's tool-call or reasoning markers); returns a logit bias towards them, so
    an output forced by a choice writes each marker as its special token, as the models of
    that format do, and not as the text's plain pieces."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    spread_weights_(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    shutil.copy(tokenizer_dir / "generation_config.json", path)
    return {str(i): 100 for i in tokenizer.convert_tokens_to_ids(markers)}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    save_tiny_llama(path, default_model_dir)
    return path


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32
    ).eval()
