"""Qwen 3.5 and Qwen3-Next, hybrid models: three of every four layers mix tokens by a Gated
DeltaNet (a state per request in place of a KV cache, after a short causal convolution), the
fourth by attention whose output a per-channel gate scales; Qwen3-Next's projections
interleave their parts by key head, and its experts are Qwen2-MoE's, some layers dense. Weir
decodes what transformers decodes (whose own reference implementation runs each sequence
whole), however the scheduler chunks, preempts and batches the requests, in one process and
by a tensor-parallel group of two, in lockstep and planning ahead; a request's state slot
returns when it ends. What such a model cannot do (drafts, adapters, prefix caching) is
refused or off."""

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tp_workload  # noqa: E402
from devices import CPU_AND_CUDA  # noqa: E402
from lora_adapters import greedy  # noqa: E402
from paged_requests import BLOCK_SIZE, NUM_BLOCKS, PagedRequests  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402
from test_model_runner import Driver, make_runner  # noqa: E402

from weir.kernels import cpu_native  # noqa: E402
from weir.services.executor.attention import get_attention_backend  # noqa: E402
from weir.services.executor.linear_states import LinearStates  # noqa: E402
from weir.services.executor.model_runner import ModelRunner  # noqa: E402
from weir.services.executor.weights import load_model  # noqa: E402
from weir.shared.lora import check_adapter  # noqa: E402
from weir.shared.model_config import LinearAttention, ModelConfig, read_model_config  # noqa: E402
from weir.shared.protocol.step import StepPlan  # noqa: E402
from weir.shared.shard_layout import ShardLayout  # noqa: E402

VOCAB = 131
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Two key heads, each serving three value heads (a group unlike the number of key heads:
    # the two cannot be mixed up); a key head wider than a value head.
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)


# Qwen 3.5's mixture of experts: the top 2 of 8 in every layer beside a gated shared expert.
EXPERTS = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


# Qwen3-Next's: Qwen2-MoE's experts in every second layer (the others dense), their
# gate/up projections not square (Qwen's transposed stacked layout told apart).
NEXT_EXPERTS = dict(EXPERTS, moe_intermediate_size=24, decoder_sparse_step=2)
KINDS = {
    "dense": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {}),
    "moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, EXPERTS),
    "next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, NEXT_EXPERTS),
}


def _save(path, kind: str = "dense", **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    config_class, model_class, experts = KINDS[kind]
    config = config_class(**{**TEXT, **experts, **changes})
    config._experts_implementation = "eager"
    model = model_class(config).eval()
    spread_weights_(model)
    with torch.no_grad():  # decays of every strength: exp(A_log) from ~0.05 to ~3
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-3.0, 1.0)
                layer.linear_attn.dt_bias.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(KINDS))
def qwen3_5(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, _save(path, request.param)


def _decodes_as_transformers(hf, path, tensor_parallel: bool = False) -> None:
    """Two prompts, 8 tokens each, decoded from ``path`` as ``hf`` decodes them greedily; with
    ``tensor_parallel``, by a group of two too."""
    prompts = [list(range(5, 30)), [20, 21, 22]]
    want = {f"r{i}": greedy(hf, prompt, 8) for i, prompt in enumerate(prompts)}
    work = tp_workload.Workload(str(path), prompts, max_tokens=8, num_blocks=20)
    group = tp_workload.run_group(work, world_size=2) if tensor_parallel else []
    assert all(report.outputs == want for report in [tp_workload.run(work), *group])


def _prompts() -> list[list[int]]:
    """Ten prompts of 1 to 70 tokens (chunked by the budget of 16, one past transformers'
    chunk of 64), more than the 8 requests that run at once: state slots are given back and
    taken again. One prompt comes twice (prefix caching is off: the second computes its own)."""
    rng = random.Random(5)
    lengths = (3, 70, 17, 40, 9, 1, 5, 33, 12)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    return [*prompts, prompts[3]]


def test_config_reads_the_layers_as_transformers_does(qwen3_5):
    path, hf = qwen3_5
    cfg = read_model_config(path)
    kinds = hf.config.layer_types
    assert cfg.linear_layers == tuple(i for i, k in enumerate(kinds) if k == "linear_attention")
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert cfg.linear_attention == LinearAttention(2, 6, 16, 8, 4)
    assert cfg.attn_output_gate and cfg.gemma_norms and cfg.qk_norm
    assert cfg.rope.rotary_dim == 4  # a quarter of each head rotates
    assert not cfg.caches_prefixes
    if hf.config.model_type != "qwen3_5_text":
        sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        assert cfg.moe_layers == tuple(sparse) and cfg.norm_topk_prob
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
        assert cfg.moe_intermediate_size == hf.config.moe_intermediate_size
        assert cfg.shared_expert_intermediate_size == 48 and cfg.shared_expert_gated
    if hf.config.model_type == "qwen3_next":
        assert cfg.moe_layers == (1, 3) and cfg.intermediate_size == 96  # the dense MLP's
        listed = {**TEXT, **NEXT_EXPERTS, "model_type": "qwen3_next", "mlp_only_layers": [3]}
        assert ModelConfig.from_hf(listed).moe_layers == (1,)
    # Left out: transformers' defaults (every fourth layer attends).
    bare = ModelConfig.from_hf({**TEXT, "model_type": "qwen3_5_text", "num_hidden_layers": 8})
    assert bare.linear_layers == (0, 1, 2, 4, 5, 6)
    with pytest.raises(ValueError, match="linear_num_value_heads 3 is not a multiple"):
        ModelConfig.from_hf({**TEXT, "model_type": "qwen3_5_text", "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="layer_types must name"):
        ModelConfig.from_hf(
            {**TEXT, "model_type": "qwen3_5_text", "layer_types": ["full_attention"] * 3}
        )
    with pytest.raises(ValueError, match="one full_attention at least"):
        ModelConfig.from_hf(
            {**TEXT, "model_type": "qwen3_5_text", "layer_types": ["linear_attention"] * 4}
        )
    with pytest.raises(ValueError, match="does not divide the model's 2 key heads"):
        ShardLayout.of(cfg, 0, 4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["lockstep", "async"])
def test_decodes_as_transformers_chunked_preempted_and_at_tp2(qwen3_5, async_scheduling):
    """Each rank holds one key head and its three value heads of every linear-attention layer;
    the layer's output projection joins the one all-reduce an attention layer has."""
    path, hf = qwen3_5
    prompts = _prompts()
    work = tp_workload.Workload(
        str(path), prompts, max_tokens=10, num_blocks=24, async_scheduling=async_scheduling
    )
    want = {f"r{i}": greedy(hf, prompt, 10) for i, prompt in enumerate(prompts)}
    one = tp_workload.run(work)
    assert one.chunked and one.preempted
    assert one.outputs == want
    assert one.prefix_cache_hits == 0
    if async_scheduling:
        return
    for report in tp_workload.run_group(work, world_size=2):
        assert report.outputs == want
        assert report.all_reduces == report.forwards * (2 * report.num_layers + 1)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(qwen3_5, device):
    path, hf32 = qwen3_5
    ids = list(range(3, 80))
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
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


@pytest.mark.skipif(cpu_native.load() is None, reason="native CPU kernels not built here")
def test_the_native_kernels_mix_the_linear_layers_in_float32_on_a_cpu(qwen3_5, monkeypatch):
    """The native kernels (the default backend in float32 on a CPU, which the other tests here
    decode with) run each Gated DeltaNet's convolution and its decodes' step; in bfloat16 and
    under the torch backend, PyTorch does."""
    path, _ = qwen3_5
    calls: Counter[str] = Counter()
    for name in ("causal_conv1d", "gated_delta_decode"):
        kernel = getattr(cpu_native.CpuKernels, name)

        def counted(*args, name=name, kernel=kernel):
            calls[name] += 1
            return kernel(*args)

        monkeypatch.setattr(cpu_native.CpuKernels, name, counted)
    # A prompt's chunk and a one-token prompt (a decode's single row) in one pass.
    input_ids, positions, meta = PagedRequests(seed=0).step([("A", [5, 6, 7], 0), ("B", [8], 0)])
    for model, want in (
        (load_model(path), 3),
        (load_model(path, dtype=torch.bfloat16), 0),
        (load_model(path, attention=get_attention_backend("torch", "cpu")), 0),
    ):
        calls.clear()
        with torch.inference_mode():
            model(input_ids, positions, meta, model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE))
        assert calls == Counter(causal_conv1d=want, gated_delta_decode=want)


def test_only_attention_layers_keep_a_kv_cache(qwen3_5):
    path, _ = qwen3_5
    model = load_model(path)
    caches = model.allocate_kv_caches(8, BLOCK_SIZE)
    assert [c.untyped_storage().nbytes() > 4 for c in caches] == [False, False, False, True]
    # K and V of one layer: 2 KV heads of 16 channels a token, float32.
    assert model.kv_cache_bytes_per_block(BLOCK_SIZE) == 2 * BLOCK_SIZE * 2 * 16 * 4


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_multimodal_checkpoint_serves_its_language_model(moe, tmp_path):
    """Qwen 3.5's checkpoints are Qwen3_5(Moe)ForConditionalGeneration: its text_config's
    language model decodes a text prompt as transformers decodes it with the whole model; the
    vision tower is left unread."""
    torch.manual_seed(0)
    classes = (
        (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)
        if moe
        else (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration)
    )
    config = classes[0](
        text_config=dict(
            TEXT,
            **(EXPERTS if moe else {}),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            num_position_embeddings=16,
        ),
        image_token_id=VOCAB - 1,
        video_token_id=VOCAB - 2,
    )
    config.text_config._experts_implementation = "eager"
    hf = classes[1](config).eval()
    spread_weights_(hf)
    hf.save_pretrained(tmp_path)
    cfg = read_model_config(tmp_path)
    assert (
        cfg.multimodal and cfg.linear_layers and cfg.model_type == hf.config.text_config.model_type
    )
    _decodes_as_transformers(hf, tmp_path)


def test_a_qwen3_next_checkpoint_reads_its_experts_one_per_tensor_or_stacked(tmp_path):
    """Qwen3-Next's Hub files hold one tensor per expert (mlp.experts.E.gate_proj.weight), as
    transformers saves them by default, and a multi-token prediction block (mtp.*), left
    unread as transformers leaves it; transformers 5 saves the experts stacked, as its
    forward multiplies them, with save_original_format=False. Both decode alike."""
    hf = _save(tmp_path / "hub", "next")
    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in tensors
    tensors["mtp.fc.weight"] = torch.ones(64, 128)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.ones(24, 64)
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    hf.save_pretrained(tmp_path / "stacked", save_original_format=False)
    stacked = load_file(tmp_path / "stacked" / "model.safetensors")
    assert stacked["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 48, 64)
    for kind in ("hub", "stacked"):
        _decodes_as_transformers(hf, tmp_path / kind)


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_attention_bias_biases_the_attention_layers_alone(kind, tmp_path):
    """attention_bias gives the attention layers' q/k/v/o projections biases (q_proj's with
    its gate's rows), not the DeltaNet's; the output projection's is added once, by rank 0."""
    _decodes_as_transformers(_save(tmp_path, kind, attention_bias=True), tmp_path, True)


def test_drafts_and_adapters_are_refused(qwen3_5, tmp_path):
    path, _ = qwen3_5
    with pytest.raises(ValueError, match="state cannot take back rejected drafts"):
        ModelRunner(path, device="cpu", kv_cache_memory_bytes=1 << 20, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="LoRA adapters of a model with linear attention"):
        check_adapter(tmp_path, read_model_config(path), max_rank=16)


def test_a_state_slot_returns_when_its_request_ends_or_is_preempted(qwen3_5):
    """Two slots: a third request runs once one of the first two finished, a fourth once the
    other was preempted; the preempted one comes back into a slot of its own, afresh."""
    path, _ = qwen3_5
    cfg = read_model_config(path)
    states = LinearStates(cfg, ShardLayout.of(cfg), 2, torch.float32, torch.device("cpu"))
    starts, first = np.array([0, 4, 5]), np.array([0, 7])
    a, b = states.step(["a", "b"], starts, first).batch.slots
    states.apply_plan(StepPlan(finished_req_ids=["a"]))
    assert states.step(["c"], starts[:2], first[:1]).batch.slots == [a]
    with pytest.raises(RuntimeError, match="request 'd': all 2 linear-attention state slots"):
        states.step(["d"], starts[:2], first[:1])
    states.apply_plan(StepPlan(preempted_req_ids=["b"]))
    step = states.step(["d"], starts[:2], first[:1])
    assert step.batch.slots == [b] and step.batch.fresh == [True]
    states.apply_plan(StepPlan(finished_req_ids=["c", "d"]))
    assert states.step(["b"], starts[:2], first[:1]).batch.fresh == [True]


@pytest.mark.parametrize("level", [1, 2])
def test_a_runner_woken_from_sleep_decodes_as_transformers(qwen3_5, level):
    """A sleep frees the states with the KV cache; waking allocates them again, and the next
    requests decode as transformers does."""
    path, hf = qwen3_5
    runner = make_runner(path)
    for prompt in ([3, 14, 15, 92, 65, 35], list(range(40, 70))):
        d = Driver(runner)
        d.add("A", prompt)
        while len(d.outputs["A"]) < 6:
            d.step({"A": None})
        assert d.outputs["A"][:6] == greedy(hf, prompt, 6)
        runner.sleep(level)
        assert runner.linear_states is None
        runner.wake()


def test_qwen3_5_s_multi_token_prediction_block_is_left_unread(tmp_path):
    hf = _save(tmp_path, "dense")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.ones(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _decodes_as_transformers(hf, tmp_path)
