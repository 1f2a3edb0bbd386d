"""PyTorch token mixers of Gated DeltaNet layers (the "linear_attention" layers of Qwen3-Next
and Qwen 3.5) over Weir's flat mixed batch.

They define the semantics faster kernels must match, and they are the path of the prefills'
recurrence everywhere, and of all of it where no kernel is given (a CPU in bfloat16). Semantics are transformers' (``models/qwen3_5/modeling_qwen3_5.py``): the
short convolution of ``causal_conv1d_fn`` / ``causal_conv1d_update`` and the recurrence of
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` with
``use_qk_l2norm_in_kernel=True``, run over each request's whole sequence at once: however a
prompt is split over steps, the outputs and states are the same up to float rounding.

Shapes (the flat mixed-batch layout, T new tokens of R requests, S state slots):
  query_start_loc [R + 1]  request r owns rows [qsl[r], qsl[r+1]) (at least one row each)
  slots           [R]      the state slot of request r (distinct within a step)
  fresh           [R]      request r's rows start its sequence (position 0): its state is
                           zero, whatever its slot holds
  x               [T, C]             the mixed q/k/v channels the convolution reads
  conv_weight     [C, K]             depthwise kernel (transformers' conv1d.weight.squeeze(1))
  conv_state      [S, C, K - 1]      each slot's last K - 1 inputs, oldest first (zeros: none)
  q, k            [T, Hk, Dk]
  v               [T, Hv, Dv]        Hv a multiple of Hk: q/k head h serves v heads
                                     h * Hv/Hk ... (h + 1) * Hv/Hk - 1
  g, beta         [T, Hv]            log decay (<= 0) and write strength of each token
  state           [S, Hv, Dk, Dv]    float32, each slot's recurrent state (keys by values)

Convolution: y_t = SiLU(bias + sum_j weight[:, j] * x_{t - (K-1) + j}), where inputs before the
request's new rows come from its conv state (zeros when fresh).

Gated delta rule, per v head, token by token, with k and q L2-normalized (eps 1e-6 inside the
square root) and q scaled by Dk ** -0.5, all in float32:
  S <- exp(g_t) * S                      decay first
  S <- S + beta_t * k_t (v_t - S^T k_t)^T    then write v_t where S's prediction of it falls short
  o_t = S^T q_t                          read after the write
Output o [T, Hv, Dv] in q's dtype.

Fresh requests are zeroed inside the functions, on the copies of the states they gather
anyway (only the fresh rows are touched), never in the slots: stale values, NaN included, do
not leak in, and each function then overwrites the slot. So the layer calls no zeroing helper,
and no slot needs clearing when a request ends or is preempted. On a CPU the native kernels
(`CpuKernels.causal_conv1d`, `.gated_delta_decode`) gather nothing: they update the slots in
place, writing a fresh request's without reading it; so does Triton's decode step on a GPU
(`triton_gated_delta.py`), passed in as a `DecodeStep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from weir.kernels.cpu_native import CpuKernels


@runtime_checkable
class DecodeStep(Protocol):
    """A kernel of the decodes' step in place in their slots: the native CPU kernels'
    (`CpuKernels.gated_delta_decode`), or Triton's on a GPU (`TritonLayerKernels`)."""

    def gated_delta_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        fresh: torch.Tensor,
    ) -> torch.Tensor: ...


CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


@dataclass(slots=True)
class StateBatch:
    """Where each request's rows and state slot are, built once per step (``build``) and shared
    by every Gated DeltaNet layer's calls. The host lists drive Python-level choices (which
    requests to run chunked, their row ranges) and the device tensors the gathers, so no call
    waits for the device to learn a length."""

    query_start_loc: list[int]
    slots: list[int]
    fresh: list[bool]
    # Requests with more than one new row, run one at a time by the chunked algorithm.
    multi_token: list[int]
    # Device tensors.
    query_start: torch.Tensor  # [R + 1] int64
    slot_index: torch.Tensor  # [R] int64
    # Fresh requests as positions (not a mask): zeroing them touches only their rows.
    fresh_at: torch.Tensor  # [F] int64, the fresh requests
    # And as flags (1: fresh), which the native kernels read per request.
    fresh_flags: torch.Tensor  # [R] int64
    token_request: torch.Tensor  # [T] int64, the request of each row
    # The single-row requests (decodes), for one vectorized recurrent step over all of them:
    # their rows, their slots, and which of them are fresh (positions among the decodes, and
    # flags).
    decode_rows: torch.Tensor  # [D] int64
    decode_slots: torch.Tensor  # [D] int64
    decode_fresh_at: torch.Tensor  # [Fd] int64
    decode_fresh_flags: torch.Tensor  # [D] int64

    @classmethod
    def build(
        cls,
        query_start_loc: Sequence[int],
        slots: Sequence[int],
        fresh: Sequence[bool],
        device: torch.device | str,
    ) -> StateBatch:
        """The step's batch; ValueError on inconsistent lengths or a request with no rows."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        num_requests = len(qsl) - 1
        if num_requests < 0 or len(slots) != num_requests or len(fresh) != num_requests:
            raise ValueError(
                f"{len(qsl)} query_start_loc entries for {len(slots)} slots and "
                f"{len(fresh)} fresh flags: want R + 1, R and R"
            )
        lengths = np.diff(qsl)
        if (lengths < 1).any() or (num_requests and qsl[0] != 0):
            raise ValueError(
                f"query_start_loc {list(query_start_loc)}: rows from 0, one or more each"
            )
        slot_arr = np.asarray(slots, dtype=np.int64)
        fresh_arr = np.asarray(fresh, dtype=bool)
        decodes = np.flatnonzero(lengths == 1)
        token_request = np.repeat(np.arange(num_requests, dtype=np.int64), lengths)
        # One host-to-device copy for the step, split into views on the device.
        parts = [
            qsl,
            slot_arr,
            np.flatnonzero(fresh_arr),
            fresh_arr,
            token_request,
            qsl[decodes],
            slot_arr[decodes],
            np.flatnonzero(fresh_arr[decodes]),
            fresh_arr[decodes],
        ]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)
        views = packed.split([len(p) for p in parts])
        return cls(
            query_start_loc=qsl.tolist(),
            slots=slot_arr.tolist(),
            fresh=fresh_arr.tolist(),
            multi_token=np.flatnonzero(lengths > 1).tolist(),
            query_start=views[0],
            slot_index=views[1],
            fresh_at=views[2],
            fresh_flags=views[3],
            token_request=views[4],
            decode_rows=views[5],
            decode_slots=views[6],
            decode_fresh_at=views[7],
            decode_fresh_flags=views[8],
        )

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1] if self.query_start_loc else 0

    @property
    def num_requests(self) -> int:
        return len(self.slots)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    batch: StateBatch,
    native: CpuKernels | None = None,
) -> torch.Tensor:
    """SiLU of each request's depthwise causal convolution over its conv state's K - 1 inputs
    then its new rows: [T, C] in x's dtype, accumulated in float32. Each request's slot of
    ``conv_state`` then holds its last K - 1 inputs (older state still among them when the
    request has fewer than K - 1 new rows). With ``native`` (the native CPU kernels, float32
    on the CPU) in one call, in place in the slots."""
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    num_requests = batch.num_requests
    if num_tokens != batch.num_tokens or conv_state.shape[1:] != (channels, width):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
            f"{tuple(conv_state.shape)} for a batch of {batch.num_tokens} rows"
        )
    if native is not None:
        return native.causal_conv1d(
            x, weight, bias, conv_state, batch.query_start, batch.slot_index, batch.fresh_flags
        )
    device = x.device
    # Lay each request out contiguously as (its K - 1 previous inputs, its new rows), so every
    # output reads one window of K consecutive rows, whether they come from state or batch.
    request = torch.arange(num_requests, device=device)
    token_at = torch.arange(num_tokens, device=device) + (batch.token_request + 1) * width
    state_at = (batch.query_start[:-1] + request * width).unsqueeze(1) + torch.arange(
        width, device=device
    )
    prior = conv_state[batch.slot_index].index_fill_(0, batch.fresh_at, 0)
    extended = x.new_empty((num_tokens + num_requests * width, channels), dtype=torch.float32)
    extended[state_at.reshape(-1)] = prior.transpose(1, 2).reshape(-1, channels).float()
    extended[token_at] = x.float()

    weight32 = weight.float()
    window = token_at - width  # the first row each output reads
    out = extended[window] * weight32[:, 0]
    for j in range(1, width + 1):
        out.addcmul_(extended[window + j], weight32[:, j])
    if bias is not None:
        out += bias.float()
    # A request's last K - 1 rows in the layout: its prior's, shifted on by its length.
    tail = state_at + (batch.query_start[1:] - batch.query_start[:-1]).unsqueeze(1)
    conv_state[batch.slot_index] = (
        extended[tail.reshape(-1)]
        .view(num_requests, width, channels)
        .transpose(1, 2)
        # Contiguous first: index_put_ from a transposed source is several times slower.
        .to(conv_state.dtype, memory_format=torch.contiguous_format)
    )
    return F.silu(out).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x over its last dimension's L2 norm, as transformers' (and FLA's) ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    batch: StateBatch,
    native: DecodeStep | None = None,
) -> torch.Tensor:
    """The gated delta rule of every request over its new rows, starting from its slot's state
    (zero when fresh): o [T, Hv, Dv] in q's dtype. Each request's slot of ``state`` then holds
    its state after its last row. Single-row requests take one recurrent step together (with
    ``native``, its kernel's: the native CPU kernels', Triton's on a GPU, in place in their
    slots); longer ones the chunked algorithm, one request at a time."""
    num_tokens, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[1:]
    if (
        num_tokens != batch.num_tokens
        or v_heads % k_heads
        or state.shape[1:] != (v_heads, k_dim, v_dim)
        or state.dtype != torch.float32
    ):
        raise ValueError(
            f"q/k {tuple(k.shape)}, v {tuple(v.shape)} and a {state.dtype} state "
            f"{tuple(state.shape)} for a batch of {batch.num_tokens} rows"
        )
    group = v_heads // k_heads
    # Normalize every row once; each q/k head serves its group of consecutive v heads
    # (`by_v_head`, where the torch paths need the heads matched up).
    q32 = l2norm(q.float()) * k_dim**-0.5
    k32 = l2norm(k.float())
    v32, g32, beta32 = v.float(), g.float(), beta.float()
    out = torch.empty((num_tokens, v_heads, v_dim), dtype=q.dtype, device=q.device)

    def by_v_head(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(group, dim=1)

    if len(batch.decode_rows):
        rows, slots = batch.decode_rows, batch.decode_slots
        if native is not None:
            o = native.gated_delta_decode(
                q32, k32, v32, g32, beta32, state, rows, slots, batch.decode_fresh_flags
            )
        else:
            states = state[slots].index_fill_(0, batch.decode_fresh_at, 0)
            o = _recurrent_step(
                by_v_head(q32[rows]),
                by_v_head(k32[rows]),
                v32[rows],
                g32[rows],
                beta32[rows],
                states,
            )
            state[slots] = states
        out[rows] = o.to(out.dtype)

    for r in batch.multi_token:
        start, end = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        slot = batch.slots[r]
        initial = state.new_zeros(state.shape[1:]) if batch.fresh[r] else state[slot]
        q_r, k_r = (by_v_head(t[start:end]).transpose(0, 1) for t in (q32, k32))
        v_r, g_r, beta_r = (t[start:end].transpose(0, 1) for t in (v32, g32, beta32))
        o, final = _chunked(q_r, k_r, v_r, g_r, beta_r, initial)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
        state[slot] = final
    return out


def _recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of each of N sequences: q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H],
    all float32; ``state`` [N, H, Dk, Dv] float32, updated in place. Returns o [N, H, Dv].

    The state is the step's largest operand (Dk x Dv per head against Dk + Dv for the token),
    so it is read once for both products: with S the state before the token and
    S' = e^g S + k u^T after it, the decayed state predicts v as e^g S^T k, and q reads
    S'^T q = e^g S^T q + (q . k) u."""
    decay = g.exp().unsqueeze(-1)
    k_read, q_read = (torch.stack((k, q), dim=-2) @ state).unbind(-2)
    write = beta.unsqueeze(-1) * (v - decay * k_read)
    state.mul_(decay.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), write.unsqueeze(-2))
    return decay * q_read + (q * k).sum(-1, keepdim=True) * write


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of L tokens by chunks of CHUNK_SIZE: q, k [H, L, Dk], v [H, L, Dv],
    g, beta [H, L], state [H, Dk, Dv], all float32. Returns (o [H, L, Dv], the new state).

    Within a chunk starting from state S, with G_i the cumulative log decay of its tokens
    through i, unrolling the recurrence gives the writes u_i = beta_i (v_i - S_{i-1}'^T k_i) as
    the solution of a unit lower-triangular system
      u_i + sum_{j<i} beta_i e^(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i e^(G_i) S^T k_i
    so U = Wv - Wk S with Wv, Wk independent of S: every chunk's Wv, Wk and intra-chunk scores
    are computed at once, and only U, the outputs and S go sequentially, chunk by chunk:
      o_i = e^(G_i) S^T q_i + sum_{j<=i} e^(G_i - G_j) (q_i . k_j) u_j
      S  <- e^(G_last) S + sum_j e^(G_last - G_j) k_j u_j^T
    """
    heads, length = g.shape
    v_dim = v.shape[-1]
    # Padded tokens have k = 0, beta = 0 and g = 0: they neither decay nor write the state.
    pad = -length % CHUNK_SIZE
    num_chunks = (length + pad) // CHUNK_SIZE
    # The work within chunks is batched over (head, chunk) as one dimension: 3-D operands,
    # whose transposes bmm reads in place where 4-D ones would be copied first.
    blocks = heads * num_chunks
    q, k, v = (F.pad(t, (0, 0, 0, pad)).reshape(blocks, CHUNK_SIZE, -1) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)).reshape(blocks, CHUNK_SIZE) for t in (g, beta))

    log_decay = g.cumsum(-1)  # G
    above = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).triu(1)
    # e^(G_i - G_j) for j <= i; masked before exp since G_i - G_j > 0 above the diagonal and
    # could overflow.
    pair_decay = (
        (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()
    )
    # The system's strictly lower part: the unitriangular solve takes its diagonal (here
    # beta_i |k_i|^2) as ones. Inverting the system and multiplying beats solving for the two
    # right-hand sides, which LAPACK would first copy to column-major order.
    system = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * pair_decay
    eye = torch.eye(CHUNK_SIZE, dtype=q.dtype, device=q.device)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    beta_k = beta.unsqueeze(-1) * k
    write_v = inverse @ (beta.unsqueeze(-1) * v)
    write_k = inverse @ (beta_k * log_decay.exp().unsqueeze(-1))
    scores = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * log_decay.exp().unsqueeze(-1)
    k_to_end = k * (log_decay[:, -1:] - log_decay).exp().unsqueeze(-1)
    chunk_decay = log_decay[:, -1].exp()

    # Back to [H, N, ...] for the scan over chunks.
    write_v, write_k, scores, q_decayed, k_to_end = (
        t.view(heads, num_chunks, CHUNK_SIZE, -1)
        for t in (write_v, write_k, scores, q_decayed, k_to_end)
    )
    chunk_decay = chunk_decay.view(heads, num_chunks, 1, 1)
    out = q.new_empty((heads, num_chunks, CHUNK_SIZE, v_dim))
    for c in range(num_chunks):
        writes = write_v[:, c] - write_k[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ writes
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ writes
    return out.view(heads, -1, v_dim)[:, :length], state
