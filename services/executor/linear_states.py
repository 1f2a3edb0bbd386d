"""Each running request's Gated DeltaNet state (Qwen 3.5's linear-attention layers), what such
a layer keeps in place of a KV cache: per layer, the last conv_kernel_size - 1 inputs of its
convolution and one float32 matrix per value head, in a row (a state slot) of the request.

A request takes a slot when it is first scheduled and gives it back when it finishes or is
preempted (recompute starts it afresh). The scheduler runs at most max_num_seqs requests, so
that many slots always suffice; they are allocated before a GPU's KV cache is sized. A chunk
that starts at position 0 starts from a zero state, whatever its slot held: a new request's,
and a preempted one's recomputed prompt.
"""

from dataclasses import dataclass

import numpy as np
import torch

from weir.kernels.gated_delta_net import StateBatch
from weir.shared.model_config import ModelConfig
from weir.shared.protocol.step import StepPlan
from weir.shared.shard_layout import ShardLayout


@dataclass(slots=True)
class LinearStep:
    """A step's state rows of its requests, and each linear-attention layer's states."""

    batch: StateBatch
    conv: dict[int, torch.Tensor]  # layer -> [slots, conv channels, conv_kernel_size - 1]
    recurrent: dict[int, torch.Tensor]  # layer -> [slots, value heads, head_k_dim, head_v_dim]


class LinearStates:
    """The state slots of one rank's linear-attention layers, and which request holds each."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: ShardLayout,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        la = cfg.linear_attention
        assert la is not None
        self.device = device
        self.num_slots = num_slots
        # The convolution's inputs in the model's dtype (as transformers caches them), the
        # recurrent state in float32 (as it computes it). Left uninitialized: a slot is
        # written before it is read, so on a CPU only the slots requests take cost memory.
        self.conv = {
            i: torch.empty(
                num_slots,
                layout.linear_conv_dim,
                la.conv_kernel_size - 1,
                dtype=dtype,
                device=device,
            )
            for i in cfg.linear_layers
        }
        self.recurrent = {
            i: torch.empty(
                num_slots,
                layout.linear_v_heads,
                la.head_k_dim,
                la.head_v_dim,
                dtype=torch.float32,
                device=device,
            )
            for i in cfg.linear_layers
        }
        self.slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def apply_plan(self, plan: StepPlan) -> None:
        """Give back the slots of the requests the plan finishes or preempts."""
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)

    def forget(self) -> None:
        """Every slot free (the executor forgot its requests)."""
        self.slot_of.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def step(
        self, req_ids: list[str], query_start_loc: np.ndarray, first_positions: np.ndarray
    ) -> LinearStep:
        """The state rows of a step's requests (slots taken for those new to it), and which
        of them start from zero: those whose chunk begins at position 0."""
        slots = []
        for req_id in req_ids:
            slot = self.slot_of.get(req_id)
            if slot is None:
                if not self._free:
                    raise RuntimeError(
                        f"request {req_id!r}: all {self.num_slots} linear-attention state slots "
                        "are held (more requests run than max_num_seqs)"
                    )
                slot = self.slot_of[req_id] = self._free.pop()
            slots.append(slot)
        return self._step(query_start_loc, slots, (first_positions == 0).tolist())

    def unserved(self, query_start_loc: np.ndarray) -> LinearStep:
        """A pass outside serving (a warm-up, a memory profile): request r in slot r, every
        one from zero; no slot is taken."""
        num_reqs = len(query_start_loc) - 1
        return self._step(query_start_loc, list(range(num_reqs)), [True] * num_reqs)

    def _step(self, query_start_loc: np.ndarray, slots: list[int], fresh: list[bool]) -> LinearStep:
        batch = StateBatch.build(query_start_loc.tolist(), slots, fresh, self.device)
        return LinearStep(batch, self.conv, self.recurrent)
