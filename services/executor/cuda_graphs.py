"""Decode steps on persistent input buffers, replayed from CUDA graphs.

A decode step's forward pass is hundreds of small kernel launches (the model is launch-bound
at decode sizes), so on CUDA it is captured once per padded batch size and replayed: one
launch instead of hundreds. A graph replays fixed device addresses and a fixed grid, so:

* Inputs live in persistent device buffers (`input_ids`, `positions`, `query_start_loc`,
  `seq_lens`, `block_table`, `slot_mapping`); each step fills pinned host staging buffers
  with NumPy and copies them in with non-blocking copies. The block table's rows are as
  wide as max_model_len (a fixed stride), but a step copies only the columns its longest
  request uses, compacted on the host and spread into the wide rows on the device.
* A step of R requests, each with the same query length q (1 for plain decodes, 1 + k for
  speculative decodes with k drafts each), and logits at every token, runs in the graph of
  the smallest captured request count B >= R. The B - R padding requests are decodes of
  query length q over a context of q keys in block 0 (any block: they only read it), with
  slot_mapping -1 so no K/V is written; their rows' logits are dropped.
* The kernels' launch parameters depend only on shapes and the host-side hints, which are
  the same for every step of a graph: the token count B * q, the request count B, the
  block table's row stride (the buffer is max_model_len wide) and max_query_len = q.

Larger steps and mixed steps (prefill chunks, unequal query lengths) run eagerly. Sampling
stays outside the graph (its parameters and shapes change every step).

The executor builds this only with CUDA graphs on (which needs CUDA). Tests build it with
``capture=False``, also on a CPU: the same buffers and padding then run the forward pass
eagerly, the path a graph replays, checkable where there is no GPU.
"""

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from weir.services.executor.attention import AttentionMetadata
from weir.services.executor.input_batch import StepInputs
from weir.services.executor.model import CausalLM

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, query_len: int) -> list[int]:
    """Request counts to capture for steps of ``query_len`` tokens per request."""
    return [
        n
        for n in CAPTURE_SIZES
        if n <= max_num_seqs and n * query_len <= min(max_num_batched_tokens, CAPTURE_SIZES[-1])
    ]


_BUFFER_NAMES = ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping")


@dataclass(slots=True)
class _Buffers:
    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    query_start_loc: torch.Tensor  # [max_reqs + 1] int32
    seq_lens: torch.Tensor  # [max_reqs] int32
    block_table: torch.Tensor  # [max_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [max_tokens] int64

    @classmethod
    def allocate(
        cls, max_reqs: int, max_tokens: int, max_blocks: int, device: torch.device, pin: bool
    ) -> "_Buffers":
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        return cls(
            input_ids=zeros(max_tokens, dtype=torch.int64),
            positions=zeros(max_tokens, dtype=torch.int64),
            query_start_loc=zeros(max_reqs + 1, dtype=torch.int32),
            seq_lens=zeros(max_reqs, dtype=torch.int32),
            block_table=zeros(max_reqs, max_blocks, dtype=torch.int32),
            slot_mapping=zeros(max_tokens, dtype=torch.int64),
        )


class DecodeGraphs:
    """Persistent input buffers and, with ``capture``, ``copies`` CUDA graphs per (requests,
    query length) of the forward pass and logits, replayed in turn (model_runner.GRAPH_COPIES
    says why). `padded_num_reqs` says whether a step fits; `stage` + `forward` run it."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_req: int,
        query_lens: tuple[int, ...] = (1,),
        capture: bool,
        copies: int = 1,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        self.block_size = kv_caches[0].shape[2]
        self.capture = capture
        self.max_blocks_per_req = max_blocks_per_req
        self.sizes = {
            q: sizes
            for q in sorted(set(query_lens))
            if (sizes := capture_sizes(max_num_seqs, max_num_batched_tokens, q))
        }
        max_reqs = max((s[-1] for s in self.sizes.values()), default=0)
        max_tokens = max((s[-1] * q for q, s in self.sizes.items()), default=0)
        on_cuda = self.device.type == "cuda"
        self.host = _Buffers.allocate(
            max_reqs, max_tokens, max_blocks_per_req, torch.device("cpu"), pin=on_cuda
        )
        self.dev = _Buffers.allocate(max_reqs, max_tokens, max_blocks_per_req, self.device, False)
        # The host's block table is used flat: [num_reqs, columns used] at its start.
        self._host_table = self.host.block_table.view(-1)
        self._dev_table = torch.empty_like(self._host_table, device=self.device)
        self._host_views = {name: getattr(self.host, name).numpy() for name in _BUFFER_NAMES}
        self._copied: torch.cuda.Event | None = None  # when the last staged inputs were read
        # Each size's captured copies and the index of the one replayed next.
        self.copies = copies
        self._graphs: dict[tuple[int, int], list[tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}
        self._turn: dict[tuple[int, int], int] = {}

    @property
    def max_num_tokens(self) -> int:
        return self.host.input_ids.shape[0]

    def padded_num_reqs(self, inputs: StepInputs) -> int | None:
        """The request count this step pads to, or None if it runs eagerly."""
        num_reqs, num_tokens = len(inputs.req_ids), len(inputs.input_ids)
        sizes = self.sizes.get(inputs.max_query_len)
        if (
            sizes is None
            or num_tokens != num_reqs * inputs.max_query_len
            or len(inputs.logits_indices) != num_tokens
        ):
            return None
        i = bisect.bisect_left(sizes, num_reqs)
        return sizes[i] if i < len(sizes) else None

    # ------------------------------------------------------------------ inputs

    def stage(self, inputs: StepInputs, num_reqs: int) -> None:
        """Fill the buffers' first ``num_reqs`` requests: the step's, then padding requests."""
        q = inputs.max_query_len
        real_reqs, real_tokens = len(inputs.req_ids), len(inputs.input_ids)
        num_tokens = num_reqs * q
        if self._copied is not None:
            # The staging buffers are rewritten only after the previous step's copies read them.
            self._copied.synchronize()
        v = self._host_views
        v["input_ids"][:real_tokens] = inputs.input_ids
        v["input_ids"][real_tokens:num_tokens] = 0
        v["positions"][:real_tokens] = inputs.rope_positions
        v["positions"][real_tokens:num_tokens] = 0
        v["slot_mapping"][:real_tokens] = inputs.slot_mapping
        v["slot_mapping"][real_tokens:num_tokens] = -1  # the cache write skips padding
        v["query_start_loc"][: real_reqs + 1] = inputs.query_start_loc
        v["query_start_loc"][real_reqs + 1 : num_reqs + 1] = np.arange(
            real_tokens + q, num_tokens + 1, q
        )
        v["seq_lens"][:real_reqs] = inputs.seq_lens
        v["seq_lens"][real_reqs:num_reqs] = q
        width = inputs.block_table.shape[1]  # >= the padding requests' one column
        table_size = num_reqs * width
        table = self._host_table[:table_size].numpy().reshape(num_reqs, width)
        table[:real_reqs] = inputs.block_table
        table[real_reqs:] = 0
        rows = {"query_start_loc": num_reqs + 1, "seq_lens": num_reqs}
        for name in _BUFFER_NAMES:
            n = rows.get(name, num_tokens)
            getattr(self.dev, name)[:n].copy_(getattr(self.host, name)[:n], non_blocking=True)
        self._dev_table[:table_size].copy_(self._host_table[:table_size], non_blocking=True)
        self.dev.block_table[:num_reqs, :width] = self._dev_table[:table_size].view(num_reqs, width)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    # ------------------------------------------------------------------ forward

    def replays(self, num_reqs: int, query_len: int) -> bool:
        """Whether ``forward`` replays a captured graph for this size (else runs eagerly)."""
        return (num_reqs, query_len) in self._graphs

    def forward(self, num_reqs: int, query_len: int) -> torch.Tensor:
        """Logits [num_reqs * query_len, vocab] of the staged step (padding rows included):
        the graph's replay if captured, else the same computation run eagerly."""
        key = (num_reqs, query_len)
        graphs = self._graphs.get(key)
        if graphs is None:
            return self._forward(num_reqs, query_len)
        turn = self._turn[key]
        self._turn[key] = (turn + 1) % len(graphs)
        graph, logits = graphs[turn]
        graph.replay()
        return logits

    def _forward(self, num_reqs: int, query_len: int) -> torch.Tensor:
        num_tokens = num_reqs * query_len
        d = self.dev
        meta = AttentionMetadata(
            query_start_loc=d.query_start_loc[: num_reqs + 1],
            seq_lens=d.seq_lens[:num_reqs],
            block_table=d.block_table[:num_reqs],
            slot_mapping=d.slot_mapping[:num_tokens],
            max_query_len=query_len,
            # An upper bound: the same for every step a graph replays.
            max_seq_len=self.max_blocks_per_req * self.block_size,
        )
        hidden = self.model(
            d.input_ids[:num_tokens], d.positions[:num_tokens], meta, self.kv_caches
        )
        logits = self.model.compute_logits(hidden)
        assert logits is not None  # graphs run without tensor parallelism
        return logits

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        if not self.capture:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for q, sizes in self.sizes.items():
            for num_reqs in reversed(sizes):
                self.stage(_no_requests(q), num_reqs)
                # Warm up outside the capture: Triton compiles and cuBLAS picks its kernels here.
                self._forward(num_reqs, q)
                torch.cuda.synchronize(self.device)
                self._graphs[(num_reqs, q)] = []
                self._turn[(num_reqs, q)] = 0
                for _ in range(self.copies):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = self._forward(num_reqs, q)
                    self._graphs[(num_reqs, q)].append((graph, logits))
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (query lengths %s, up to %d tokens) in %.2fs",
            len(self._graphs),
            sorted(self.sizes),
            self.max_num_tokens,
            time.perf_counter() - start,
        )


def _no_requests(query_len: int) -> StepInputs:
    """The inputs of a step without requests: staged, the buffers hold padding only."""
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(
        req_ids=[],
        slots=empty,
        input_ids=empty,
        positions=empty,
        rope_positions=empty,
        query_start_loc=np.zeros(1, dtype=np.int32),
        seq_lens=empty,
        block_table=np.zeros((0, 1), dtype=np.int32),
        slot_mapping=empty,
        num_spec=empty,
        num_logits=empty,
        logits_indices=empty,
        max_query_len=query_len,
        max_seq_len=0,
        prompt_logits_indices=empty,
        prompt_targets=empty,
        num_prompt_logits=empty,
    )
