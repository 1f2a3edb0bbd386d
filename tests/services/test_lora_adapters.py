"""What the executor and the scheduler refuse of a LoRA adapter, in one line naming the file
and the problem, and how ``--lora-modules`` is read."""

import argparse
import json
import shutil

import pytest
import torch
from lora_adapters import save_random_adapter
from safetensors.torch import load_file, save_file

from weir.services.engine.executor_group import ExecutorGroup, ExpectedExecutor
from weir.services.engine.lora_registry import LoraRegistry
from weir.services.executor.attention import get_attention_backend
from weir.services.executor.lora import LoraAdapters, load_adapter
from weir.services.executor.weights import load_model
from weir.shared.config import EngineArgs
from weir.shared.lora import LoraModule, check_adapter, parse_lora_modules, read_adapter_config
from weir.shared.model_config import read_model_config
from weir.shared.protocol import control

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return save_random_adapter(
        tiny_model_dir,
        tmp_path_factory.mktemp("adapters") / "a",
        seed=0,
        targets=["q_proj", "v_proj", "down_proj"],
        rank=4,
        alpha=8,
    )


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir, attention=get_attention_backend("torch", "cpu"))


def _copy(adapter, tmp_path, config_changes=None, tensors=None):
    out = tmp_path / "copy"
    out.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file(weights if tensors is None else tensors(weights), out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"use_dora": True}, "use_dora (DoRA) is not supported"),
        ({"bias": "all"}, "bias 'all' (a trained bias) is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save (whole trained modules)"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern (a rank per module)"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens (activated LoRA)"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' (only LORA) is not supported"),
        ({"r": 32}, "rank 32 is above --max-lora-rank 16: raise it"),
        ({"r": 0}, "r must be a positive int, got 0"),
        ({"lora_alpha": "8"}, "lora_alpha must be a number, got '8'"),
    ],
)
def test_an_adapter_config_weir_cannot_serve_is_refused(adapter, tmp_path, change, refusal):
    with pytest.raises(ValueError, match="adapter_config.json: ") as refused:
        read_adapter_config(_copy(adapter, tmp_path, change), max_rank=16)
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_a_pickled_or_missing_adapter_is_refused(adapter, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json there"):
        read_adapter_config(tmp_path, 16)
    (tmp_path / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    torch.save({}, tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle, which Weir never loads"):
        read_adapter_config(tmp_path, 16)


def test_rslora_scales_by_the_root_of_the_rank(adapter, tmp_path):
    assert read_adapter_config(adapter, 16).scaling == 8 / 4
    assert read_adapter_config(_copy(adapter, tmp_path, {"use_rslora": True}), 16).scaling == 4


def _renamed(weights, old, new):
    return {k.replace(old, new): v for k, v in weights.items()}


@pytest.mark.parametrize(
    ("tensors", "refusal"),
    [
        (
            lambda w: {
                **w,
                "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 8),
            },
            "is not a LoRA A or B matrix of a q/k/v/o/gate/up/down projection",
        ),
        (
            lambda w: _renamed(w, "layers.1.", "layers.7."),
            "is past the model's 2 layers: the adapter was trained for another model",
        ),
        (
            lambda w: {k: v for k, v in w.items() if "layers.0.self_attn.q_proj.lora_B" not in k},
            "self_attn.q_proj of layer 0 has lora_A or lora_B only",
        ),
        (
            lambda w: {k: v[:, 1:].clone() if "q_proj.lora_A" in k else v for k, v in w.items()},
            "has shape (4, 31), not (4, 32): the adapter was trained for another model",
        ),
        (lambda w: {}, "holds no LoRA matrices"),
    ],
)
def test_adapter_weights_that_do_not_fit_the_model_are_refused(
    adapter, tiny_model, tmp_path, tensors, refusal
):
    path = _copy(adapter, tmp_path, tensors=tensors)
    with pytest.raises(ValueError) as refused:
        load_adapter(tiny_model, LoraModule("x", str(path)), max_rank=16)
    assert refusal in str(refused.value)


def test_lora_modules_are_name_equals_path_each_name_once():
    assert LoraModule.parse("sql=/a/b=c") == LoraModule("sql", "/a/b=c")
    # vLLM's JSON form (its base_model_name only names the parent in its model cards).
    as_json = '{"name": "sql", "path": "/a/b=c", "base_model_name": "org/base"}'
    assert LoraModule.parse(as_json) == LoraModule("sql", "/a/b=c")
    for spec, refusal in (
        ("sql", "is not name=path"),
        ("sql=", "is not name=path"),
        ("=/a", "adapter name '' must be"),
        ("a b=/a", "adapter name 'a b' must be"),
        ('{"name": "sql"', "is not JSON"),
        ('{"name": "sql", "path": 3}', "needs a string name and path"),
        ('{"name": "sql", "path": "/a", "rank": 8}', r"unknown field\(s\) \['rank'\]"),
        ('{"name": "a b", "path": "/a"}', "adapter name 'a b' must be"),
    ):
        with pytest.raises(ValueError, match=refusal):
            LoraModule.parse(spec)
    with pytest.raises(ValueError, match="adapter name 'a' is given twice"):
        parse_lora_modules(("a=/x", "a=/y"), ())
    with pytest.raises(ValueError, match="is the served model's name"):
        EngineArgs(lora_modules=("m=/x",), served_model_name="m")
    with pytest.raises(ValueError, match="'b' is the served model's name"):
        EngineArgs(lora_modules=("b=/x",), served_model_name=["a", "b"])
    with pytest.raises(ValueError, match="repeats a name"):
        EngineArgs(served_model_name=("a", "a"))


def test_an_adapter_may_not_take_the_served_models_name():
    """Whether the name is given (--served-model-name) or the model directory's."""
    with pytest.raises(ValueError, match="adapter name 'smol' is the served model's name"):
        LoraRegistry({LoraModule("smol", "/x"): "f"}, ("smol",))


def test_lora_modules_reach_each_role_as_given():
    args = EngineArgs(lora_modules=["a=/x", "b=/y z"], max_loras=2, max_lora_rank=64)
    assert args.lora_modules == ("a=/x", "b=/y z") and args.lora_enabled
    assert [m.name for m in args.loras] == ["a", "b"]
    for role in ("scheduler", "executor"):
        parser = argparse.ArgumentParser()
        EngineArgs.add_cli_args(parser, role)
        again = EngineArgs.from_cli(parser.parse_args(args.to_argv(role)))
        assert again.lora_modules == args.lora_modules and again.max_lora_rank == 64
    assert args.scheduler_config(512).max_loras == 2
    assert EngineArgs(max_loras=2).scheduler_config(512).max_loras == 0  # no adapters, no limit
    assert EngineArgs(lora_modules="a=/x").lora_modules == ("a=/x",)


def test_an_executor_with_other_adapters_is_turned_away():
    """The scheduler would send it requests of adapters it does not hold, or holds other
    files of (the same names are not the same adapters). The order does not matter."""
    args = EngineArgs(lora_modules=("a=/x", "b=/y"))
    wanted = {"a": "f1", "b": "f2"}
    group = ExecutorGroup(
        None, ExpectedExecutor(1, "m", 10, 64, args, wanted), 3.0, print, print, lambda *_: None
    )
    hello = control.ExecutorHello(
        "s", 0, 1, "m", 10, 100, args.block_size, *args.step_limits, 64, [2], "float32", "cpu", "torch", lora_adapters={"b": "f2", "a": "f1"},
    )  # fmt: skip
    assert group._check_hello(hello) is None
    hello.lora_adapters = {"a": "f1"}
    assert group._check_hello(hello) == (
        "executor serves LoRA adapters ['a'], scheduler serves ['a', 'b']: give both the same "
        "--lora-modules"
    )
    hello.lora_adapters = {"a": "f1", "b": "f3"}
    assert group._check_hello(hello) == (
        "executor's LoRA adapter files of ['b'] differ from the scheduler's: give both the same "
        "adapters"
    )


def test_the_scheduler_checks_an_adapters_tensors_without_torch(adapter, tiny_model_dir, tmp_path):
    """The scheduler refuses at start-up what an executor would refuse: the shapes too."""
    model = read_model_config(tiny_model_dir)
    files = check_adapter(adapter, model, 16)
    assert files.config.rank == 4 and len(files.pairs) == 6  # 3 modules x 2 layers
    # The fingerprint covers the config and the weights.
    same = shutil.copytree(adapter, tmp_path / "same")
    assert check_adapter(same, model, 16).fingerprint == files.fingerprint
    (tmp_path / "changed").mkdir()
    changed = _copy(
        adapter, tmp_path / "changed", tensors=lambda w: {k: v * 2 for k, v in w.items()}
    )
    assert check_adapter(changed, model, 16).fingerprint != files.fingerprint
    garbage = _copy(adapter, tmp_path)
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="adapter_model.safetensors: not a readable safetensors"):
        check_adapter(garbage, model, 16)


def test_an_executor_loads_what_a_plan_names_and_only_the_scheduler_files(adapter, tiny_model):
    """The adapters a plan lists are held, the others dropped; files that are not the ones
    the scheduler read (another fingerprint) are not loaded."""
    fingerprint = check_adapter(adapter, tiny_model.config, 16).fingerprint
    loras = LoraAdapters([])
    loras.sync(tiny_model, {"a#1": [str(adapter), "not its files"]}, 16)
    assert loras.ids == {}
    loras.sync(tiny_model, {"a#1": [str(adapter), fingerprint]}, 16)
    loras.sync(
        tiny_model, {"a#1": [str(adapter), fingerprint], "b#2": [str(adapter), fingerprint]}, 16
    )
    assert loras.ids == {"a#1": 1, "b#2": 2}
    loras.sync(tiny_model, {"b#2": [str(adapter), fingerprint]}, 16)
    assert loras.ids == {"b#2": 2} and loras.adapters[0] is None
    loras.sync(
        tiny_model, {"b#2": [str(adapter), fingerprint], "c#3": [str(adapter), fingerprint]}, 16
    )
    assert loras.ids == {"b#2": 2, "c#3": 1}  # the freed place is taken again
