"""Random LoRA adapters saved by PEFT itself, and greedy decoding by transformers (PEFT's
models too) as the reference."""

from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(
    base_dir: Path,
    out: Path,
    *,
    seed: int,
    targets: list[str],
    rank: int,
    alpha: float,
    rslora: bool = False,
    std: float = 0.05,
    bare: bool = False,
) -> Path:
    """A PEFT LoRA adapter of ``base_dir``'s model with random A and B (PEFT initializes B
    to zero, which would change nothing), written by ``save_pretrained``; ``bare``: of the
    transformer without its LM head (``AutoModel``, as embedding models are adapted)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoModelForCausalLM

    model_class = AutoModel if bare else AutoModelForCausalLM
    base = model_class.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out)
    return out


def peft_model(base_dir: Path, adapter_dir: Path | None, bare: bool = False):
    """transformers' model of ``base_dir`` with PEFT's adapter on it (None: the base);
    ``bare``: the transformer without its LM head."""
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM

    model_class = AutoModel if bare else AutoModelForCausalLM
    base = model_class.from_pretrained(base_dir, dtype=torch.float32).eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()


def greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """A full forward pass per token, argmax, no end-of-sequence stop."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def cached_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy generation with its KV cache, one forward pass per new token:
    LongRoPE's rotation depends on the pass (the prompt's, then each new token's)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        ids = [int(out.logits[0, -1].argmax())]
        while len(ids) < num_tokens:
            out = model(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
            ids.append(int(out.logits[0, -1].argmax()))
    return ids
