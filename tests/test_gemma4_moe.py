"""Gemma 4's mixture of experts (gemma-4-26B-A4B's enable_moe_block): each layer runs experts
beside its dense MLP, the experts on a norm of their own, routed by the residual itself
(normalized, scaled by a learned vector) with a learned factor of each chosen expert's weight;
each branch's output is normalized before the two are summed. Weir reads the config as
transformers does and decodes what transformers decodes (its loop over experts), however the
scheduler chunks, preempts and drafts, in one process and by a tensor-parallel group of two,
whose one all-reduce after the MLP sums both branches' partial sums."""

import dataclasses
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tp_workload  # noqa: E402
from devices import CPU_AND_CUDA  # noqa: E402
from lora_adapters import greedy  # noqa: E402
from paged_requests import BLOCK_SIZE, NUM_BLOCKS, PagedRequests  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402

from weir.services.executor.weights import load_model  # noqa: E402
from weir.shared.model_config import ExpertRouting, ModelConfig, read_model_config  # noqa: E402
from weir.shared.shard_layout import ShardLayout  # noqa: E402

VOCAB = 131
# Two kinds of layers (the full-attention ones with wider heads, fewer KV heads, values from
# their keys), the last two sharing earlier layers' KV with twice as wide a dense MLP,
# per-layer inputs: the dense model's features around the experts.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    layer_types=[
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    sliding_window=8,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=VOCAB,
    max_position_embeddings=256,
    final_logit_softcapping=10.0,
    # Untied: with random weights a tied head mostly predicts the last token again.
    tie_word_embeddings=False,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
)


@torch.no_grad()
def _spread_weights_(model: torch.nn.Module, layers: torch.nn.ModuleList) -> None:
    """`spread_weights_`, and random layer scalars and routers' scales of the decoder
    ``layers``."""
    spread_weights_(model)
    for layer in layers:
        layer.layer_scalar.uniform_(0.5, 1.5)  # a buffer: spread_weights_ left it at 1
        # Router logits of a few units (the scale multiplies a normalized input by
        # hidden ** -0.5): choices far from ties; factors of every size.
        layer.router.scale.normal_(0.0, 8.0)
        layer.router.per_expert_scale.uniform_(0.3, 2.0)


def _save(path) -> torch.nn.Module:
    """A random Gemma 4 MoE model saved as transformers saves it (each layer's experts stacked);
    returned as transformers runs it, its experts one by one."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(**TEXT)
    config._experts_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(config).eval()
    _spread_weights_(model, model.model.layers)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_moe")
    return path, _save(path)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(5)]


def test_config_reads_the_experts_as_transformers_does(gemma4_moe):
    path, hf = gemma4_moe
    cfg = read_model_config(path)
    hf_cfg = hf.config
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer, "experts")]
    assert cfg.moe_layers == tuple(sparse) == tuple(range(5))
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (hf_cfg.num_experts, hf_cfg.top_k_experts)
    assert cfg.moe_intermediate_size == hf_cfg.moe_intermediate_size == 32
    assert cfg.intermediate_size == hf_cfg.intermediate_size == 48  # the dense MLP's, beside
    assert cfg.for_layer(4).intermediate_size == 96  # a KV-sharing layer's double-wide MLP
    # Renormalizing scales a token's experts' sum as a whole, which post_feedforward_layernorm_2
    # undoes (but for its eps): decoding hardly shows it, the config does.
    assert cfg.norm_topk_prob and cfg.experts_beside_mlp and cfg.float32_norms
    assert cfg.routing == ExpertRouting(input_norm=True, per_expert_scale=True)
    assert cfg.shared_expert_intermediate_size == 0
    # Each rank holds half of every expert's columns and of the dense MLP's.
    layout = ShardLayout.of(cfg, 1, 2)
    assert (layout.moe_intermediate_size, layout.intermediate_size) == (16, 24)
    # Without enable_moe_block, Gemma 4 is dense whatever else its config says of experts.
    moe = hf_cfg.to_dict()
    dense = ModelConfig.from_hf({**moe, "enable_moe_block": False})
    assert (dense.num_experts, dense.moe_layers, dense.experts_beside_mlp) == (0, (), False)
    with pytest.raises(ValueError, match="top_k_experts 9 is more than the 8 experts"):
        ModelConfig.from_hf({**moe, "top_k_experts": 9})
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        with pytest.raises(ValueError, match=f"config.json has no '{key}'"):
            ModelConfig.from_hf({**moe, key: None})


def test_decodes_as_transformers_chunked_preempted_and_at_tp2(gemma4_moe):
    """Each rank holds half of every expert's columns and of the dense MLP's, the router whole:
    both branches' partial sums are reduced side by side by the layer's one all-reduce after
    its MLP (each is normalized whole before the two are added), as many as a dense layer's."""
    path, hf = gemma4_moe
    prompts = _prompts()
    work = tp_workload.Workload(
        str(path), prompts, max_tokens=10, num_blocks=20, num_speculative_tokens=2
    )
    want = {f"r{i}": greedy(hf, prompt, 10) for i, prompt in enumerate(prompts)}
    one = tp_workload.run(work)
    assert one.chunked and one.preempted and one.draft_tokens > 0
    assert one.outputs == want
    for report in tp_workload.run_group(work, world_size=2):
        assert report.outputs == want
        assert report.all_reduces == report.forwards * (2 * report.num_layers + 1)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(gemma4_moe, device):
    """In bfloat16 the experts run by the grouped matmul (float32 on a CPU packs them one by
    one); Weir rounds where it sums the experts otherwise than transformers, and folds the
    router's two scales into one, so the two bf16 results differ: each is as far from the
    float32 logits as the other, at the typical position (the median of the positions' mean
    errors)."""
    path, hf32 = gemma4_moe
    ids = list(range(3, 60))
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, experts_implementation="eager"
    )
    with torch.no_grad():
        want = hf32(torch.tensor([ids])).logits[0]
        hf_logits = hf16.to(device).eval()(torch.tensor([ids], device=device)).logits[0]
        hf_error = (hf_logits.float().cpu() - want).abs().mean(dim=1).median()
    model = load_model(path, device=device, dtype=torch.bfloat16)
    input_ids, positions, meta = PagedRequests(seed=0).step([("A", ids, 0)])
    meta = dataclasses.replace(
        meta,
        **{f: getattr(meta, f).to(device) for f in ("query_start_loc", "seq_lens", "block_table")},
        slot_mapping=meta.slot_mapping.to(device),
    )
    with torch.inference_mode():
        kv = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        logits = model.compute_logits(model(input_ids.to(device), positions.to(device), meta, kv))
    error = (logits.cpu() - want).abs().mean(dim=1).median()
    assert error < 1.5 * hf_error, (error, hf_error)


def test_a_checkpoint_its_config_does_not_describe_is_refused(gemma4_moe, tmp_path):
    """Experts of another size than config.json's, or experts where it says the model has
    none, fail by name rather than load a slice of each."""
    path, _ = gemma4_moe
    hf_cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    for changes, error in (
        ({"moe_intermediate_size": 16}, r"experts\.\w+_proj: checkpoint shape \(8, 64, \d+\)"),
        ({"enable_moe_block": False}, "config.json gives the model no experts"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**hf_cfg, **changes}))
        save_file(tensors, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=error):
            load_model(tmp_path)
    # A dense Gemma 4 checkpoint whose config says it has experts lacks their tensors.
    dense = {k: v for k, v in tensors.items() if ".router." not in k and ".experts." not in k}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    save_file(dense, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint does not fill"):
        load_model(tmp_path)


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """gemma-4-26B-A4B is a Gemma4ForConditionalGeneration: its language model's stacked
    experts, under model.language_model., decode a text prompt as transformers decodes it with
    the whole model; the vision tower is left unread."""
    torch.manual_seed(0)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = transformers.Gemma4Config(
        text_config=TEXT, vision_config=vision, tie_word_embeddings=False
    )
    config.text_config._experts_implementation = "eager"
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    _spread_weights_(hf, hf.model.language_model.layers)
    hf.save_pretrained(tmp_path)
    assert read_model_config(tmp_path).multimodal
    prompts = _prompts()[:2]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=6, num_blocks=40)
    want = {f"r{i}": greedy(hf, prompt, 6) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want
