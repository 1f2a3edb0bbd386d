"""The executor's persistent batch grows its slot arrays without losing what they hold."""

from pathlib import Path

import numpy as np
import pytest

from weir.services.executor.input_batch import InputBatch
from weir.shared.protocol.step import NewRequest
from weir.shared.sampling import SamplingParams


def test_growing_keeps_every_slots_state_and_adds_unused_rows() -> None:
    batch = InputBatch(max_model_len=64, block_size=16, capacity=1, eos_token_ids=(2,))
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=-(2**63), logprobs=3)
    batch._add(NewRequest("a", [5, 6, 7], params, [4], 0))
    # A token sampled by a step in flight, then known: growing copies the columns in use.
    batch.fill_reserved(batch.reserve_tokens(np.array([0])), np.array([11]))
    assert batch.token_ids[0, :4].tolist() == [5, 6, 7, 11]
    before = {name: getattr(batch, name).copy() for name, *_ in batch._arrays()}
    batch._add(NewRequest("b", [8], SamplingParams(), [9], 0))  # no free slot: grows
    assert batch.capacity == 2 and batch.slot_of == {"a": 0, "b": 1}
    for name, dtype, row_shape, _ in batch._arrays():
        grown = getattr(batch, name)
        assert grown.shape == (2, *row_shape) and grown.dtype == np.dtype(dtype), name
        assert np.array_equal(grown[0], before[name][0]), name
    assert batch.seed[0] == -(2**63) and batch.num_logprobs[1] == -1 and batch.top_p[1] == 1
    batch._grow(4)
    assert batch.top_p[2:].tolist() == [1, 1] and batch.num_logprobs[2:].tolist() == [-1, -1]
    assert sorted(batch._free) == [2, 3]


def _mapping(array: np.ndarray) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``array``."""
    address = array.__array_interface__["data"][0]
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's smaps")
def test_a_request_makes_kilobytes_of_its_rows_resident_never_huge_pages() -> None:
    # At max_model_len 131,072 a slot's token row is 512 KiB; with huge pages the first write
    # to a slot faulted in (and zeroed) 2 MiB, milliseconds each on a VM.
    batch = InputBatch(max_model_len=131_072, block_size=16, capacity=256, eos_token_ids=(2,))
    for i in range(64):
        batch._add(NewRequest(f"r{i}", list(range(1, 33)), SamplingParams(), [i], 0))
    for array in (batch.token_ids, batch.block_table):
        mapping = _mapping(array)
        assert "nh" in mapping["VmFlags"].split(), mapping["VmFlags"]
        assert int(mapping["AnonHugePages"].split()[0]) == 0
        assert int(mapping["Rss"].split()[0]) <= 64 * 8, mapping["Rss"]  # kB: a page or two a row
    assert batch.token_ids[:64, :32].tolist() == [list(range(1, 33))] * 64
    assert not batch.token_ids[:, 32:].any() and not batch.token_ids[64:].any()
