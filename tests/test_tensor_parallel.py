"""Tensor parallelism on the CPU (gloo): sharded ranks decode exactly what one process does,
their shards are the checkpoint cut Megatron-style, and each layer costs two all-reduces."""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tp_workload  # noqa: E402
from lora_adapters import ALL_PROJECTIONS, greedy, peft_model, save_random_adapter  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402

from weir.services.executor.attention import get_attention_backend  # noqa: E402
from weir.services.executor.model_runner import ModelRunner  # noqa: E402
from weir.services.executor.parallel import TensorParallel  # noqa: E402
from weir.services.executor.weights import iter_safetensors, load_model  # noqa: E402
from weir.shared.model_config import ModelConfig  # noqa: E402
from weir.shared.shard_layout import ShardLayout  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """4 query heads and a single KV head (replicated at TP=2), biases everywhere (the
    row-parallel ones are added once), and a vocabulary of 131 (padded to 2 x 66)."""
    path = tmp_path_factory.mktemp("tiny-tp")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=131,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=500.0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    spread_weights_(model)
    model.save_pretrained(path)
    return path


def _check_group_matches_one_process(work: tp_workload.Workload, world_size: int) -> None:
    want = tp_workload.run(work)
    assert want.chunked and want.preempted, "the workload must chunk prefills and preempt"
    if work.num_speculative_tokens:
        assert want.draft_tokens > 0, "the workload must verify drafts"
    reports = tp_workload.run_group(work, world_size)
    assert reports[0].outputs == want.outputs
    for report in reports:
        # Every rank ran the same steps and got rank 0's tokens.
        assert report.outputs == want.outputs
        assert report.forwards == want.forwards
        # Per forward pass: one all-reduce after o_proj and one after down_proj in every
        # layer, one for the vocabulary-parallel embedding.
        assert report.all_reduces == report.forwards * (2 * report.num_layers + 1)
        assert report.gathers == report.broadcasts == want.sampling_steps


def test_tiny_model_at_tp2_decodes_like_one_process_with_drafts(tiny_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(131) for _ in range(rng.randrange(5, 30))] for _ in range(5)]
    work = tp_workload.Workload(
        str(tiny_dir), prompts, max_tokens=10, num_blocks=20, num_speculative_tokens=2
    )
    _check_group_matches_one_process(work, world_size=2)


def test_lora_adapters_decode_as_peft_does_in_one_process_and_at_tp2(tiny_dir, tmp_path):
    """Requests of two adapters and of the base model share steps (chunked, preempted):
    each decodes what PEFT's model decodes, and a group of two ranks, each holding half of
    every adapter's matrices, decodes the same."""
    pytest.importorskip("peft")
    adapters = {
        "every": save_random_adapter(
            tiny_dir,
            tmp_path / "every",
            seed=1,
            targets=ALL_PROJECTIONS,
            rank=4,
            alpha=8,
            rslora=True,
            std=0.3,
        ),
        "some": save_random_adapter(
            tiny_dir,
            tmp_path / "some",
            seed=2,
            targets=["q_proj", "v_proj", "down_proj"],
            rank=8,
            alpha=16,
            std=0.3,
        ),
    }
    rng = random.Random(11)
    prompts = [[rng.randrange(131) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    names = [None, "every", "some", "every", "some", None]
    work = tp_workload.Workload(
        str(tiny_dir),
        prompts,
        max_tokens=10,
        num_blocks=20,
        loras=[f"{name}={path}" for name, path in adapters.items()],
        lora_names=names,
    )
    references = {name: peft_model(tiny_dir, adapters.get(name)) for name in set(names)}
    want = {
        f"r{i}": greedy(references[name], prompt, 10)
        for i, (prompt, name) in enumerate(zip(prompts, names))
    }
    base = {f"r{i}": greedy(references[None], prompt, 10) for i, prompt in enumerate(prompts)}
    assert all(want[r] != base[r] for r, name in zip(want, names) if name), "adapters must matter"
    one = tp_workload.run(work)
    assert one.chunked and one.preempted
    assert one.outputs == want
    for report in tp_workload.run_group(work, world_size=2):
        assert report.outputs == want


def test_smollm2_at_tp3_decodes_like_one_process(default_model_dir):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randrange(6, 24))] for _ in range(4)]
    work = tp_workload.Workload(str(default_model_dir), prompts, max_tokens=8, num_blocks=16)
    _check_group_matches_one_process(work, world_size=3)


def _shards(model_dir, world_size: int):
    """Every rank's model, loaded without a process group (loading needs no collective)."""
    attention = get_attention_backend("torch", "cpu")
    return [
        load_model(model_dir, attention=attention, tp=TensorParallel(rank, world_size))
        for rank in range(world_size)
    ]


def _reassemble(shards, name: str) -> torch.Tensor:
    """The checkpoint tensor ``name`` rebuilt from the ranks' shards."""
    cfg, n = shards[0].config, len(shards)
    d = cfg.head_dim
    q, kv, inter = (
        cfg.num_heads * d // n,
        max(cfg.num_kv_heads // n, 1) * d,
        cfg.intermediate_size // n,
    )
    # With fewer KV heads than ranks, consecutive ranks hold copies of the same head.
    kv_owners = range(0, n, max(n // cfg.num_kv_heads, 1))
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name == "lm_head.weight":  # prepacked at load time on the CPU
            return torch.cat([s.packed_lm_head.dense_weight() for s in shards])[: cfg.vocab_size]
        return torch.cat([s.embed_tokens for s in shards])[: cfg.vocab_size]
    if name == "model.norm.weight":
        return _same_on_every_rank([s.norm.weight for s in shards])
    layer_index, rest = name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    layers = [s.layers[int(layer_index)] for s in shards]

    def p(layer, attr):
        linear = getattr(layer, attr)
        packed = kind == "weight" and hasattr(linear, "dense_weight")
        return linear.dense_weight() if packed else getattr(linear, kind)

    if module == "self_attn.q_proj":
        return torch.cat([p(layer, "qkv_proj")[:q] for layer in layers])
    if module in ("self_attn.k_proj", "self_attn.v_proj"):
        rows = slice(q, q + kv) if module == "self_attn.k_proj" else slice(q + kv, q + 2 * kv)
        for r in range(n):  # replicas agree with their owner
            owner = max(o for o in kv_owners if o <= r)
            assert torch.equal(p(layers[r], "qkv_proj")[rows], p(layers[owner], "qkv_proj")[rows])
        return torch.cat([p(layers[r], "qkv_proj")[rows] for r in kv_owners])
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        rows = slice(0, inter) if module == "mlp.gate_proj" else slice(inter, 2 * inter)
        return torch.cat([p(layer, "gate_up_proj")[rows] for layer in layers])
    if module in ("self_attn.o_proj", "mlp.down_proj"):
        attr = "o_proj" if module == "self_attn.o_proj" else "down_proj"
        if kind == "bias":  # added once, by rank 0
            assert all(getattr(layer, attr).bias is None for layer in layers[1:])
            return p(layers[0], attr)
        return torch.cat([p(layer, attr) for layer in layers], dim=1)
    attr = {
        "input_layernorm": "input_layernorm",
        "post_attention_layernorm": "post_attention_layernorm",
        "self_attn.q_norm": "q_norm",
        "self_attn.k_norm": "k_norm",
    }[module]
    return _same_on_every_rank([p(layer, attr) for layer in layers])


def _same_on_every_rank(tensors: list[torch.Tensor]) -> torch.Tensor:
    for t in tensors[1:]:
        assert torch.equal(t, tensors[0])
    return tensors[0]


@pytest.mark.parametrize(("model", "world_size"), [("tiny", 2), ("tiny", 4), ("smollm2", 3)])
def test_every_ranks_shards_reassemble_to_the_checkpoint(
    model, world_size, tiny_dir, default_model_dir
):
    model_dir = tiny_dir if model == "tiny" else default_model_dir
    shards = _shards(model_dir, world_size)
    cfg = shards[0].config
    # The KV cache of a rank holds its own KV heads only.
    assert shards[0].allocate_kv_caches(1, 4)[0].shape[3] == max(cfg.num_kv_heads // world_size, 1)
    for name, source in iter_safetensors(model_dir):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        assert torch.equal(_reassemble(shards, name), source[(slice(None),)]), name


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_indivisible_tensor_parallel_size_is_refused_in_one_line(default_model_dir, world_size):
    with pytest.raises(ValueError) as refused:
        ModelRunner(default_model_dir, device="cpu", tensor_parallel_size=world_size, rank=0)
    message = str(refused.value)
    assert "\n" not in message
    assert f"tensor_parallel_size {world_size}" in message and "9 attention heads" in message


def _config(**overrides) -> ModelConfig:
    hf = dict(
        model_type="llama",
        vocab_size=131,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    return ModelConfig.from_hf({**hf, **overrides})


def test_layout_gives_each_rank_its_heads_and_replicates_scarce_kv_heads():
    layouts = [ShardLayout.of(_config(), rank, 4) for rank in range(4)]
    assert [(s.q_head_start, s.num_heads) for s in layouts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # 2 KV heads, 4 ranks: query heads 0-3 read KV head 0, 4-7 read KV head 1.
    assert [(s.kv_head_start, s.num_kv_heads) for s in layouts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [s.vocab_start for s in layouts] == [0, 33, 66, 99] and layouts[0].vocab_per_rank == 33
    assert {s.intermediate_size for s in layouts} == {24}
    whole = ShardLayout.of(_config())
    assert (whole.num_heads, whole.num_kv_heads, whole.vocab_per_rank) == (8, 2, 131)


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({}, 3, "tensor_parallel_size 3 does not divide the model's 8 attention heads"),
        ({"num_key_value_heads": 4}, 8, None),
        ({"num_key_value_heads": 8, "num_attention_heads": 8}, 8, None),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 8},
            2,
            "model's 3 KV heads",
        ),
        ({"intermediate_size": 90}, 4, "does not divide the model's 90 MLP columns"),
    ],
)
def test_layout_refuses_what_does_not_split(overrides, world_size, message):
    if message is None:
        ShardLayout.of(_config(**overrides), world_size - 1, world_size)
        return
    with pytest.raises(ValueError, match=message):
        ShardLayout.of(_config(**overrides), 0, world_size)
