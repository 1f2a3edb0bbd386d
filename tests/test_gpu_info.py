"""NVML's view of the GPU a launcher's executors will run on (`shared.gpu_info`)."""

import pytest
import torch

from weir.shared.gpu_info import probe_gpu


def test_a_cpu_device_is_no_gpu(monkeypatch):
    assert probe_gpu("cpu") is None
    # No GPU visible to CUDA is none to NVML either (where there is a driver at all).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe_gpu(None) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert probe_gpu("cuda") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvml_names_the_cuda_device_torch_runs_on():
    props = torch.cuda.get_device_properties(0)
    gpu = probe_gpu(None)
    assert gpu is not None and gpu == probe_gpu("cuda:0")
    assert gpu.name == props.name
    # The same memory, but for what the driver keeps and the two count differently.
    assert abs(gpu.total_memory - props.total_memory) < 2 * 2**30
    assert probe_gpu(f"cuda:{torch.cuda.device_count()}") is None
