"""Hugging Face transformers baselines for `bench throughput`, on the same weights and token ids as Weir.

- hf-static: `model.generate` on fixed batches in request order, left padded, greedy.
  A batch decodes max(output_len) of its requests (min_new_tokens = max_new_tokens,
  so EOS cannot stop it early); only each request's own output_len counts as output.
- hf-cb: transformers continuous batching (the manager behind `generate_batch`),
  each request submitted with its own max_new_tokens and EOS disabled (-1).

Timing starts after the model is loaded and one short warmup generation has run,
as for Weir.
"""

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weir.services.bench.report import EngineRun
from weir.services.bench.workload import WARMUP_PROMPT, BenchRequest
from weir.shared.arith import cdiv

if TYPE_CHECKING:
    from transformers import ContinuousBatchingManager

    # What AutoModelForCausalLM loads: a PreTrainedModel with GenerationMixin's generate and
    # continuous batching; transformers names that type only for type checkers.
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


logger = logging.getLogger(__name__)

# Left-padding id; its value never matters because the attention mask hides it.
_PAD_TOKEN_ID = 0
_CB_RESULT_POLL_S = 1.0
_CB_PAGE_SIZE = 256


def load_hf_model(
    model_dir: Path, dtype: str, device: str, load_format: str = "auto"
) -> "CausalLM":
    """transformers' model of ``model_dir``; ``load_format="dummy"``: its own random
    initialisation of the same shape (the baselines' speed does not depend on the values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model: CausalLM
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    # In place, as Module.to and eval are; the wraps(Module.to) on transformers' override gives
    # a type whose call binds no self.
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _static_generate(model: "CausalLM", batch: list[BenchRequest]) -> int:
    """Generate one left-padded batch; returns the number of tokens decoded per row."""
    from transformers import GenerationConfig

    max_prompt = max(len(r.prompt_token_ids) for r in batch)
    new_tokens = max(r.output_len for r in batch)
    rows = [
        [_PAD_TOKEN_ID] * (max_prompt - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch
    ]
    mask = [
        [0] * (max_prompt - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch
    ]
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=_PAD_TOKEN_ID,
    )
    out = model.generate(
        input_ids=torch.tensor(rows, device=model.device),
        attention_mask=torch.tensor(mask, device=model.device),
        generation_config=config,
    )
    if not isinstance(out, torch.Tensor):  # a GenerateOutput only where return_dict_in_generate
        raise TypeError(f"hf-static generate returned {type(out).__name__}, not the token ids")
    decoded = out.shape[1] - max_prompt
    if decoded != new_tokens:
        raise RuntimeError(f"hf-static decoded {decoded} tokens per row, expected {new_tokens}")
    return decoded


@torch.inference_mode()
def run_hf_static(model: "CausalLM", requests: list[BenchRequest], batch_size: int) -> EngineRun:
    device = str(model.device)
    _static_generate(model, [BenchRequest(list(WARMUP_PROMPT), 2)])
    _sync(device)
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        generated += _static_generate(model, batch) * len(batch)
    _sync(device)
    wall = time.perf_counter() - start
    return EngineRun(
        engine="hf-static",
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        generated_tokens=generated,
        wall_s=wall,
        notes=f"batch size {batch_size}, request order, each batch decodes its longest output_len",
    )


def _cb_collect(
    manager: "ContinuousBatchingManager", request_ids: set[str]
) -> dict[str, list[int]]:
    """Wait for every request in request_ids; returns their generated token ids."""
    outputs: dict[str, list[int]] = {}
    while len(outputs) < len(request_ids):
        result = manager.get_result(timeout=_CB_RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(
                    f"hf-cb generation thread stopped with {len(request_ids) - len(outputs)} left"
                )
            continue
        if result.request_id not in request_ids or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        outputs[result.request_id] = list(result.generated_tokens)
    return outputs


@torch.inference_mode()
def run_hf_continuous(
    model: "CausalLM", requests: list[BenchRequest], max_batch_tokens: int
) -> EngineRun:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device = str(model.device)
    max_output = max(r.output_len for r in requests)
    config = GenerationConfig(max_new_tokens=max_output, do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
        max_generated_length=max_output,
        num_requests=len(requests),
    )
    # Without an explicit size the manager sizes its KV cache from host memory on CPU (most of the RAM).
    cb_config = ContinuousBatchingConfig(
        num_blocks=sum(
            cdiv(len(r.prompt_token_ids) + r.output_len, _CB_PAGE_SIZE) for r in requests
        )
        + 1,
        page_size=_CB_PAGE_SIZE,
        max_batch_tokens=max_batch_tokens,
    )
    with model.continuous_batching_context_manager(
        generation_config=config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        workload_hints=hints,
    ) as manager:
        manager.add_request(
            list(WARMUP_PROMPT), request_id="warmup", max_new_tokens=2, eos_token_id=-1
        )
        _cb_collect(manager, {"warmup"})
        _sync(device)
        ids = [f"bench-{i}" for i in range(len(requests))]
        start = time.perf_counter()
        for request_id, r in zip(ids, requests):
            manager.add_request(
                r.prompt_token_ids,
                request_id=request_id,
                max_new_tokens=r.output_len,
                eos_token_id=-1,
            )
        outputs = _cb_collect(manager, set(ids))
        _sync(device)
        wall = time.perf_counter() - start
    return EngineRun.from_outputs(
        "hf-cb",
        requests,
        [len(outputs[request_id]) for request_id in ids],
        wall,
        "transformers continuous batching manager (generate_batch's engine), per-request max_new_tokens",
    )
