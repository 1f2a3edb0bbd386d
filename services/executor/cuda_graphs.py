"""Steps on persistent input buffers, replayed from CUDA graphs.

A step's forward pass is hundreds of kernel launches, and at the sizes a server runs most
(decodes, and prefill chunks of a few thousand tokens beside them) the host's launches,
not the GPU, set its time. So on CUDA the forward pass is captured once per padded step
shape and replayed: one launch instead of hundreds. A graph replays fixed device
addresses and a fixed grid, so:

* Inputs live in one staging area, pinned on the host and mirrored on the device: each
  shape's (`input_ids`, `positions`, `slot_mapping`, `logits_indices`, `query_start_loc`,
  `seq_lens`) at offsets of its own, the addresses its graph reads. A step fills the host's
  with NumPy and moves it in one non-blocking copy (each copy is a driver call and a few
  torch calls on the host, which sets a decode step's pace). The block table's rows are as
  wide as max_model_len (a fixed stride): a step stages only the columns its longest request
  uses, compacted, which the device spreads into the wide rows of `block_table`.
* Decode shapes: a step of R requests, each with the same query length q (1 for plain
  decodes, 1 + k for speculative decodes with k drafts each), and logits at every token,
  runs in the graph of the smallest captured request count B >= R (CAPTURE_SIZES). The
  B - R padding requests are decodes of query length q over a context of q keys in block
  0 (any block: they only read it), with slot_mapping -1 so no K/V is written.
* Mixed shapes: any other step (prefill chunks beside decodes, prefills, unequal query
  lengths) of T tokens runs in the graph of the smallest captured token count P >= T
  (MIXED_TOKEN_SIZES, up to --max-mixed-graph-tokens), with min(P, max_num_seqs)
  requests (each request of a step has a token in it, so no step of P tokens has more).
  Its P - T padding tokens belong to no request (slot_mapping -1, so the cache
  kernel writes nothing, and attention leaves their rows unspecified); the padding
  requests hold no token (their query starts and ends at T), so the attention kernels'
  programs for them return at once, but each takes its place on an SM: the fewer, the
  better. The hidden states are gathered at the rows `logits_indices` names, one per
  request of the shape (padding rows name row 0).
* The kernels' launch parameters depend only on shapes and the host-side hints, which are
  the same for every step of a graph: the token and request counts, the block table's row
  stride (the buffer is max_model_len wide) and max_query_len (q for a decode shape; P for
  a mixed shape, whose plan launches prefill tiles for long queries and decode tiles for
  the rest, whatever the step's longest query is).

Larger steps, steps with prompt logprobs and steps with more logits rows than max_num_seqs
run eagerly. A graph ends at the hidden states of the rows a step samples from, padding rows
last: the LM head and sampling run outside it, on the step's own rows. A graph's output
stays allocated as long as the graph, and hidden rows are vocab / hidden_size times smaller
than logits (63x for Llama-3.2-1B: fine request counts cost no memory to speak of), and
padding rows never reach the LM head, the largest GEMM of a decode step, for one launch.

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
from weir.shared.config import MAX_MIXED_GRAPH_TOKENS

logger = logging.getLogger(__name__)

# Request counts of the decode shapes: vLLM's up to 512 (a step pads by at most 7 requests up
# to 256; powers of two padded the benchmark's decode steps by 24%: benchmarks/step_kinds.py),
# then every 32 up to the 1,024 requests vLLM's H200 limits allow. vLLM runs larger decodes
# piecewise; here they would replay a mixed shape, whose prefill launch and max_num_seqs
# request slots cost them programs that do nothing.
CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 512, 16), *range(512, 1025, 32))
# Token counts of the mixed shapes: finer where most mixed steps fall (the scheduler's
# default budget is 2048 tokens), so a step pads by at most 256 tokens there.
MIXED_TOKEN_SIZES = (
    *(128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096, 6144),
    MAX_MIXED_GRAPH_TOKENS,
)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, query_len: int) -> list[int]:
    """Request counts to capture for steps of ``query_len`` tokens per request."""
    return [
        n
        for n in CAPTURE_SIZES
        if n <= max_num_seqs and n * query_len <= min(max_num_batched_tokens, CAPTURE_SIZES[-1])
    ]


def mixed_sizes(
    max_num_batched_tokens: int, max_mixed_tokens: int = MAX_MIXED_GRAPH_TOKENS
) -> list[int]:
    """Token counts to capture mixed steps at: every step of up to ``max_mixed_tokens`` (and
    the step budget) fits one; none for 0."""
    cap = min(max_num_batched_tokens, max_mixed_tokens)
    return [n for n in MIXED_TOKEN_SIZES if n < cap] + ([cap] if cap else [])


@dataclass(frozen=True, slots=True)
class GraphShape:
    """A captured step's padded shape: what its graph's launches are fixed for."""

    num_reqs: int
    num_tokens: int
    max_query_len: int  # the attention kernels' hint
    mixed: bool  # sampled rows at `logits_indices` (num_reqs of them), else every token

    @property
    def num_logits(self) -> int:
        """Rows of the graph's output (hidden states of the rows sampled from)."""
        return self.num_reqs if self.mixed else self.num_tokens


def graph_shapes(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    query_lens: tuple[int, ...],
    max_mixed_tokens: int = MAX_MIXED_GRAPH_TOKENS,
) -> list[GraphShape]:
    """Every shape captured: decode shapes per query length, then mixed shapes."""
    decode = [
        GraphShape(n, n * q, q, mixed=False)
        for q in sorted(set(query_lens))
        for n in capture_sizes(max_num_seqs, max_num_batched_tokens, q)
    ]
    mixed = [
        GraphShape(min(n, max_num_seqs), n, n, mixed=True)
        for n in mixed_sizes(max_num_batched_tokens, max_mixed_tokens)
    ]
    return decode + mixed


# Every staged input starts at a multiple of this many bytes, as a fresh allocation does
# (Triton specializes its kernels on pointers divisible by 16: no new variant to compile).
_ALIGN = 256


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _graph_inputs(shape: GraphShape) -> tuple[list[tuple[str, torch.dtype, int, int]], int]:
    """Where a shape's graph inputs lie in the staging area: (name, dtype, byte offset,
    length) each, and the byte they end at."""
    r, t = shape.num_reqs, shape.num_tokens
    fields, offset = [], 0
    for name, dtype, length in (
        ("input_ids", torch.int64, t),
        ("positions", torch.int64, t),
        ("slot_mapping", torch.int64, t),
        ("logits_indices", torch.int64, r if shape.mixed else 0),  # rows a mixed step samples
        ("query_start_loc", torch.int32, r + 1),
        ("seq_lens", torch.int32, r),
    ):
        fields.append((name, dtype, offset, length))
        offset = _aligned(offset + length * dtype.itemsize)
    return fields, offset


def _views(
    area: torch.Tensor, fields: list[tuple[str, torch.dtype, int, int]]
) -> dict[str, torch.Tensor]:
    return {name: area[at : at + n * dtype.itemsize].view(dtype) for name, dtype, at, n in fields}


@dataclass(slots=True)
class _StagedInputs:
    """One shape's graph inputs in the staging area: views of the host's copy and the
    device's (the graph's fixed addresses); the step's other inputs begin at ``end``."""

    host: dict[str, np.ndarray]
    dev: dict[str, torch.Tensor]
    end: int  # bytes


# A graph's outputs: the rows to sample from, and the auxiliary hidden states (or None).
GraphOutputs = tuple[torch.Tensor, torch.Tensor | None]


class StepGraphs:
    """Persistent input buffers and, with ``capture``, ``copies`` CUDA graphs per step
    shape of the forward pass (to the sampled rows' hidden states), replayed in turn
    (model_runner.GRAPH_COPIES says why). `shape_for` says which shape a step pads to;
    `stage` + `forward` run it."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_req: int,
        query_lens: tuple[int, ...] = (1,),
        max_mixed_tokens: int = MAX_MIXED_GRAPH_TOKENS,
        capture: bool,
        copies: int = 1,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        self.block_size = kv_caches[0].shape[2]
        self.capture = capture
        self.max_blocks_per_req = max_blocks_per_req
        self.shapes = graph_shapes(
            max_num_seqs, max_num_batched_tokens, query_lens, max_mixed_tokens
        )
        # What shape_for searches: the decode shapes' request counts per query length (and
        # the shapes by both), the mixed shapes in order of their token counts.
        self.sizes: dict[int, list[int]] = {}
        self._decode: dict[tuple[int, int], GraphShape] = {}
        for shape in self.shapes:
            if not shape.mixed:
                self.sizes.setdefault(shape.max_query_len, []).append(shape.num_reqs)
                self._decode[shape.num_reqs, shape.max_query_len] = shape
        self._mixed = [shape for shape in self.shapes if shape.mixed]
        self._mixed_tokens = [shape.num_tokens for shape in self._mixed]
        max_reqs = max(shape.num_reqs for shape in self.shapes)
        max_tokens = max(shape.num_tokens for shape in self.shapes)
        self.block_table = torch.zeros(
            max_reqs, max_blocks_per_req, dtype=torch.int32, device=self.device
        )
        # One staging area, on the host (pinned) and on the device, holds all a step stages,
        # so one copy moves it: the graph's inputs at its shape's offsets, then the block
        # table's used columns (spread into `block_table`'s wide rows on the device) and the
        # indices of the tokens fed from the step before.
        layouts = {shape: _graph_inputs(shape) for shape in self.shapes}
        graph_bytes = max(end for _, end in layouts.values())
        size = graph_bytes + _aligned(4 * max_reqs * max_blocks_per_req) + 2 * 8 * max_tokens
        on_cuda = self.device.type == "cuda"
        self._host_area = torch.empty(size, dtype=torch.uint8, pin_memory=on_cuda)
        self._host_bytes = self._host_area.numpy()
        self._dev_area = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._staged = {
            shape: _StagedInputs(
                host={n: v.numpy() for n, v in _views(self._host_area, fields).items()},
                dev=_views(self._dev_area, fields),
                end=end,
            )
            for shape, (fields, end) in layouts.items()
        }
        self._copied: torch.cuda.Event | None = None  # when the last staged inputs were read
        # Each shape's captured copies and the index of the one replayed next.
        self.copies = copies
        self._graphs: dict[GraphShape, list[tuple[torch.cuda.CUDAGraph, GraphOutputs]]] = {}
        self._turn: dict[GraphShape, int] = {}

    def shape_for(self, inputs: StepInputs) -> GraphShape | None:
        """The shape this step pads to, or None if it runs eagerly."""
        num_reqs, num_tokens = len(inputs.req_ids), len(inputs.input_ids)
        num_logits = len(inputs.logits_indices)
        if len(inputs.prompt_logits_indices):
            return None
        q = inputs.max_query_len
        sizes = self.sizes.get(q, [])
        i = bisect.bisect_left(sizes, num_reqs)
        if num_tokens == num_reqs * q and num_logits == num_tokens and i < len(sizes):
            return self._decode[sizes[i], q]
        i = bisect.bisect_left(self._mixed_tokens, num_tokens)
        if i == len(self._mixed):
            return None
        shape = self._mixed[i]
        return shape if num_reqs <= shape.num_reqs and num_logits <= shape.num_logits else None

    # ------------------------------------------------------------------ inputs

    def stage(
        self, inputs: StepInputs, shape: GraphShape, fed: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fill the shape's inputs: the step's first, then padding. ``fed`` (int64, any
        shape: the indices of the tokens fed from the step before) travels in the same
        copy. Returns the device's input ids and copy of ``fed``."""
        num_reqs, num_tokens = shape.num_reqs, shape.num_tokens
        real_reqs, real_tokens = len(inputs.req_ids), len(inputs.input_ids)
        if self._copied is not None:
            # The staging area is rewritten only after the previous step's copy read it.
            self._copied.synchronize()
        staged = self._staged[shape]
        v = staged.host
        v["input_ids"][:real_tokens] = inputs.input_ids
        v["input_ids"][real_tokens:] = 0
        v["positions"][:real_tokens] = inputs.rope_positions
        v["positions"][real_tokens:] = 0
        v["slot_mapping"][:real_tokens] = inputs.slot_mapping
        v["slot_mapping"][real_tokens:] = -1  # the cache write skips padding
        v["query_start_loc"][: real_reqs + 1] = inputs.query_start_loc
        if shape.mixed:
            # Padding requests hold no token; padding tokens belong to none of them.
            v["query_start_loc"][real_reqs + 1 :] = real_tokens
            v["seq_lens"][real_reqs:] = 0
            num_logits = len(inputs.logits_indices)
            v["logits_indices"][:num_logits] = inputs.logits_indices
            v["logits_indices"][num_logits:] = 0
        else:
            q = shape.max_query_len
            v["query_start_loc"][real_reqs + 1 :] = np.arange(real_tokens + q, num_tokens + 1, q)
            v["seq_lens"][real_reqs:] = q
        v["seq_lens"][:real_reqs] = inputs.seq_lens
        width = inputs.block_table.shape[1]  # >= the padding requests' one column
        table_at, table_end = staged.end, staged.end + 4 * num_reqs * width
        table = self._host_bytes[table_at:table_end].view(np.int32).reshape(num_reqs, width)
        table[:real_reqs] = inputs.block_table
        table[real_reqs:] = 0
        end = fed_at = _aligned(table_end)
        if fed is not None:
            end = fed_at + 8 * fed.size
            self._host_bytes[fed_at:end].view(np.int64).reshape(fed.shape)[...] = fed
        self._dev_area[:end].copy_(self._host_area[:end], non_blocking=True)
        self.block_table[:num_reqs, :width] = (
            self._dev_area[table_at:table_end].view(torch.int32).view(num_reqs, width)
        )
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        if fed is None:
            return staged.dev["input_ids"], None
        return staged.dev["input_ids"], self._dev_area[fed_at:end].view(torch.int64).view(fed.shape)

    # ------------------------------------------------------------------ forward

    def replays(self, shape: GraphShape) -> bool:
        """Whether ``forward`` replays a captured graph for this shape (else runs eagerly)."""
        return shape in self._graphs

    def forward(self, shape: GraphShape) -> GraphOutputs:
        """Hidden states [shape.num_logits, hidden_size] of the staged step's rows to sample
        from (padding rows included, after the step's), and every row's auxiliary hidden
        states where the model keeps them (``CausalLM.forward_with_aux``): the graph's
        replay if captured, else the same computation run eagerly."""
        graphs = self._graphs.get(shape)
        if graphs is None:
            return self._forward(shape)
        turn = self._turn[shape]
        self._turn[shape] = (turn + 1) % len(graphs)
        graph, outputs = graphs[turn]
        graph.replay()
        return outputs

    def _forward(self, shape: GraphShape) -> GraphOutputs:
        d = self._staged[shape].dev
        meta = AttentionMetadata(
            query_start_loc=d["query_start_loc"],
            seq_lens=d["seq_lens"],
            block_table=self.block_table[: shape.num_reqs],
            slot_mapping=d["slot_mapping"],
            max_query_len=shape.max_query_len,
            # An upper bound: the same for every step a graph replays.
            max_seq_len=self.max_blocks_per_req * self.block_size,
        )
        hidden, aux = self.model.forward_with_aux(
            d["input_ids"], d["positions"], meta, self.kv_caches
        )
        return (hidden[d["logits_indices"]] if shape.mixed else hidden), aux

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every shape, largest first so the smaller graphs reuse its memory pool."""
        if not self.capture:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: (s.num_tokens, s.num_reqs), reverse=True):
            self.stage(_no_requests(shape.max_query_len), shape)
            # Warm up outside the capture: Triton compiles and cuBLAS picks its kernels here.
            self._forward(shape)
            torch.cuda.synchronize(self.device)
            self._graphs[shape] = []
            self._turn[shape] = 0
            for _ in range(self.copies):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self._forward(shape)
                # Replayed once here, over the staged padding: a graph's first launch uploads
                # it to the device, which a step would otherwise wait for the first time its
                # shape comes (as the running requests' count falls, shape after shape).
                graph.replay()
                self._graphs[shape].append((graph, outputs))
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graph shapes (decode query lengths %s up to %d requests, mixed "
            "steps up to %d tokens) in %.2fs",
            len(self._graphs),
            sorted(self.sizes),
            max((n for sizes in self.sizes.values() for n in sizes), default=0),
            max(self._mixed_tokens, default=0),
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
