"""The executor's persistent batch grows its slot arrays without losing what they hold."""

import numpy as np

from weir.services.executor.input_batch import InputBatch
from weir.shared.protocol.step import NewRequest
from weir.shared.sampling import SamplingParams


def test_growing_keeps_every_slots_state_and_adds_unused_rows() -> None:
    batch = InputBatch(max_model_len=64, block_size=16, capacity=1, eos_token_ids=(2,))
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=-(2**63), logprobs=3)
    batch._add(NewRequest("a", [5, 6, 7], params, [4], 0))
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
