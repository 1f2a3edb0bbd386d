"""The default model (SmolLM2-135M-Instruct) served by ModelRunner decodes exactly like transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_runner import Driver  # noqa: E402

from weir.services.executor.model_runner import ModelRunner  # noqa: E402
from weir.shared.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

NUM_NEW = 32
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]


@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    """Chat prompts and transformers' greedy continuations (EOS disabled, so all have 32 tokens)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = (
        None  # generate() falls back to it when the call's is None
    )
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=NUM_NEW,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    prompts, outputs = [], []
    with torch.no_grad():
        for text in CHATS:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            # An explicit mask: the prompt contains the pad token (<|im_end|>), which generate() would mask.
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            prompts.append(ids)
            outputs.append(out[0, len(ids) :].tolist())
    return prompts, outputs


def test_batched_greedy_decode_matches_transformers(default_model_dir, hf_reference):
    prompts, want = hf_reference
    runner = ModelRunner(
        default_model_dir,
        device="cpu",
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    driver = Driver(runner)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    names = [f"chat{i}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        driver.add(name, prompt, params)
    # The first prompt's prefill is split over two steps, while the others prefill in one.
    driver.step({names[0]: 10, **{n: None for n in names[1:]}})
    while any(len(driver.outputs[n]) < NUM_NEW for n in names):
        driver.step({n: None for n in names if len(driver.outputs[n]) < NUM_NEW})
    assert [driver.outputs[n] for n in names] == want
