"""The Gated DeltaNet token mixers against transformers' Qwen 3.5 functions run on each whole
sequence at once, however the sequences are split over steps.

Each schedule splits seven requests (1 to 130 tokens: around the chunk size of 64, and
shorter than the convolution's K - 1 = 3) into chunks over several steps (some chunks whole
multiples of 64, which need no padding), with decodes and prefill chunks in one batch, rows
not in request order, slots not in request order, and stale values (NaN among them) in every
slot before its request starts. The decay scale differs per head, from barely decaying (state
carried over a whole sequence matters) to forgetting within a few tokens. The native CPU
kernels (the convolution, the decodes' step) run the same schedules, and match the PyTorch
path call by call: on heads narrower and wider than their vector blocks, slots out of order,
fresh requests' slots full of NaN, the other slots untouched.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from native_builds import BUILDS, build
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from weir.kernels import gated_delta_net as gdn
from weir.kernels.cpu_native import CpuKernels
from weir.kernels.gated_delta_net import StateBatch, causal_conv1d, gated_delta_rule

K_HEADS, V_HEADS, K_DIM, V_DIM, CONV_K = 2, 4, 16, 8, 4
CHANNELS = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
LENGTHS = [1, 2, 3, 63, 64, 65, 130]
# Each request's slot, out of NUM_SLOTS.
SLOT_OF = [5, 0, 8, 2, 7, 3, 1]
NUM_SLOTS = 9
# Per v head: how fast it forgets (g = -scale * uniform(0, 1)).
DECAY_SCALE = torch.tensor([0.01, 0.1, 0.5, 3.0])


@dataclass
class Schedule:
    """Request r runs chunk c of ``chunks[r]`` at step ``start[r] + c``."""

    chunks: list[list[int]]
    start: list[int]


SCHEDULES = {
    "whole": Schedule([[n] for n in LENGTHS], [0] * len(LENGTHS)),
    "split": Schedule(
        [[1], [1, 1], [2, 1], [1, 62], [3, 61], [64, 1], [64, 1, 65]],
        [4, 0, 1, 0, 2, 3, 0],
    ),
    "decodes": Schedule(
        [[1], [2], [1, 1, 1], [59, 1, 1, 1, 1], [1, 1, 62], [58] + [1] * 7, [70, 1, 1, 58]],
        [0, 3, 0, 1, 0, 2, 0],
    ),
    # Chunks of whole multiples of the chunk size (no padding), several in one call.
    "aligned": Schedule(
        [[1], [2], [3], [32, 31], [64], [1, 64], [128, 2]],
        [0, 0, 0, 0, 1, 0, 0],
    ),
}


@dataclass
class RequestInputs:
    x: torch.Tensor  # [L, C] convolution input
    q: torch.Tensor  # [L, Hk, Dk]
    k: torch.Tensor
    v: torch.Tensor  # [L, Hv, Dv]
    g: torch.Tensor  # [L, Hv]
    beta: torch.Tensor


def make_sequences(seed: int) -> list[RequestInputs]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return [
        RequestInputs(
            x=randn(n, CHANNELS),
            q=randn(n, K_HEADS, K_DIM),
            k=randn(n, K_HEADS, K_DIM),
            v=randn(n, V_HEADS, V_DIM),
            g=-torch.rand(n, V_HEADS, generator=gen) * DECAY_SCALE,
            beta=torch.sigmoid(randn(n, V_HEADS)),
        )
        for n in LENGTHS
    ]


def conv_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(CHANNELS, CONV_K, generator=gen) * 0.5
    return weight, torch.randn(CHANNELS, generator=gen) * 0.1


def steps(schedule: Schedule) -> Iterator[list[tuple[int, int, int]]]:
    """Each step's (request, first token, tokens) in its row order: shuffled, decodes mixed in."""
    gen = torch.Generator().manual_seed(1)
    last = max(s + len(c) for s, c in zip(schedule.start, schedule.chunks))
    for step in range(last):
        batch = []
        for r, (start, chunks) in enumerate(zip(schedule.start, schedule.chunks)):
            c = step - start
            if 0 <= c < len(chunks):
                batch.append((r, sum(chunks[:c]), chunks[c]))
        order = torch.randperm(len(batch), generator=gen).tolist()
        yield [batch[i] for i in order]


@dataclass
class Result:
    conv_out: list[torch.Tensor]
    conv_state: torch.Tensor  # [R, C, K-1], each request's slot at the end
    out: list[torch.Tensor]
    state: torch.Tensor  # [R, Hv, Dk, Dv]


def run_weir(
    seqs: list[RequestInputs],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    schedule: Schedule,
    dtype: torch.dtype = torch.float32,
    native: CpuKernels | None = None,
) -> Result:
    gen = torch.Generator().manual_seed(2)
    conv_state = torch.randn(NUM_SLOTS, CHANNELS, CONV_K - 1, generator=gen).to(dtype) * 100
    state = torch.randn(NUM_SLOTS, V_HEADS, K_DIM, V_DIM, generator=gen) * 100
    conv_state[SLOT_OF[0], 3] = float("nan")
    state[SLOT_OF[1], 1, 2] = float("nan")
    conv_out = [torch.full((n, CHANNELS), float("nan"), dtype=dtype) for n in LENGTHS]
    out = [torch.full((n, V_HEADS, V_DIM), float("nan"), dtype=dtype) for n in LENGTHS]
    for rows in steps(schedule):
        qsl = [0]
        for _, _, n in rows:
            qsl.append(qsl[-1] + n)
        batch = StateBatch.build(
            qsl, [SLOT_OF[r] for r, _, _ in rows], [first == 0 for _, first, _ in rows], "cpu"
        )

        x, q, k, v, g, beta = (
            torch.cat([getattr(seqs[r], field)[a : a + n] for r, a, n in rows])
            for field in ("x", "q", "k", "v", "g", "beta")
        )
        y = causal_conv1d(x.to(dtype), weight.to(dtype), bias, conv_state, batch, native)
        o = gated_delta_rule(
            q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state, batch, native
        )
        for (r, a, n), s in zip(rows, qsl):
            conv_out[r][a : a + n] = y[s : s + n]
            out[r][a : a + n] = o[s : s + n]
    return Result(conv_out, conv_state[SLOT_OF].float(), out, state[SLOT_OF])


def run_transformers(seqs: list[RequestInputs], weight: torch.Tensor, bias: torch.Tensor) -> Result:
    """Each whole sequence at once, in float32, from zero state."""
    conv_out, conv_state, out, state = [], [], [], []
    for s in seqs:
        x = s.x.float().T.unsqueeze(0)  # [1, C, L]
        conv_out.append(hf.causal_conv1d_fn(x, weight, bias, activation="silu")[0].T)
        conv_state.append(F.pad(x[0], (CONV_K - 1, 0))[:, -(CONV_K - 1) :])
        o, final = hf.torch_chunk_gated_delta_rule(
            *(t.float().unsqueeze(0) for t in (s.q, s.k, s.v, s.g, s.beta)),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert final is not None
        out.append(o[0])
        state.append(final[0])
    return Result(conv_out, torch.stack(conv_state), out, torch.stack(state))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Within ``rtol`` of the expected tensor's largest magnitude (elementwise relative error
    means nothing where a sum cancels to near zero)."""
    assert actual.shape == expected.shape
    err = (actual.float() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g}, {err / scale:.3g} of {scale:.3g}"


def compare(got: Result, want: Result, rtol: float) -> None:
    for r in range(len(LENGTHS)):
        assert_close(got.conv_out[r], want.conv_out[r], rtol)
        assert_close(got.out[r], want.out[r], rtol)
    assert_close(got.conv_state, want.conv_state, rtol)
    assert_close(got.state, want.state, rtol)


@pytest.mark.parametrize("kernels", [pytest.param(None, id="torch"), *BUILDS])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_matches_transformers_on_whole_sequences(schedule: str, kernels: str | None) -> None:
    seqs = make_sequences(0)
    weight, bias = conv_weights(0)
    native = None if kernels is None else build(kernels)
    compare(
        run_weir(seqs, weight, bias, SCHEDULES[schedule], native=native),
        run_transformers(seqs, weight, bias),
        1e-5,
    )


def test_conv_without_bias() -> None:
    seqs = make_sequences(3)
    weight, bias = conv_weights(3)
    got = run_weir(seqs, weight, None, SCHEDULES["split"])
    want = run_transformers(seqs, weight, torch.zeros_like(bias))
    for r in range(len(LENGTHS)):
        assert_close(got.conv_out[r], want.conv_out[r], 1e-5)


def test_bf16_inputs_against_float32() -> None:
    """bf16 q/k/v/x (and conv state), float32 recurrent state: the float32 reference of the
    same rounded inputs, to bf16's precision."""
    seqs = make_sequences(4)
    for s in seqs:
        for field in ("x", "q", "k", "v", "beta"):
            setattr(s, field, getattr(s, field).bfloat16().float())
    weight, bias = conv_weights(4)
    weight = weight.bfloat16().float()
    got = run_weir(seqs, weight, bias, SCHEDULES["split"], dtype=torch.bfloat16)
    assert all(o.dtype == torch.bfloat16 for o in got.out + got.conv_out)
    compare(got, run_transformers(seqs, weight, bias), 1e-2)


def test_decodes_take_one_step_and_prefills_one_call_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"step": 0, "chunked": 0}
    step, chunked = gdn._recurrent_step, gdn._chunked

    def count(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return wrapped

    monkeypatch.setattr(gdn, "_recurrent_step", count("step", step))
    monkeypatch.setattr(gdn, "_chunked", count("chunked", chunked))
    lengths = [1, 5, 1, 1, 2, 1]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    batch = StateBatch.build(
        qsl, [3, 0, 5, 1, 2, 4], [False, True, False, True, False, False], "cpu"
    )
    assert batch.multi_token == [1, 4]
    assert batch.decode_rows.tolist() == [0, 6, 7, 10]
    assert batch.decode_slots.tolist() == [3, 5, 1, 4]
    assert batch.fresh_at.tolist() == [1, 3]
    assert batch.decode_fresh_at.tolist() == [2]
    t = qsl[-1]
    gated_delta_rule(
        torch.randn(t, K_HEADS, K_DIM),
        torch.randn(t, K_HEADS, K_DIM),
        torch.randn(t, V_HEADS, V_DIM),
        -torch.rand(t, V_HEADS),
        torch.rand(t, V_HEADS),
        torch.zeros(6, V_HEADS, K_DIM, V_DIM),
        batch,
    )
    assert calls == {"step": 1, "chunked": 2}


@pytest.mark.parametrize(
    ("qsl", "slots", "fresh"),
    [([0, 1, 1], [0, 1], [True, True]), ([0, 2], [0, 1], [True]), ([1, 2], [0], [True])],
)
def test_state_batch_refuses_inconsistent_steps(
    qsl: list[int], slots: list[int], fresh: list[bool]
) -> None:
    with pytest.raises(ValueError):
        StateBatch.build(qsl, slots, fresh, "cpu")


# Decodes (fresh ones among them) beside prefill chunks (a fresh one shorter than the conv
# state); slots out of request order, some unused.
NATIVE_LENGTHS = [1, 1, 5, 1, 1, 2, 1]
NATIVE_SLOTS = [6, 2, 0, 7, 4, 8, 1]
NATIVE_FRESH = [False, True, False, False, True, True, False]
NATIVE_NUM_SLOTS = 10


def mixed_batch(lengths: list[int], slots: list[int], fresh: list[bool]) -> StateBatch:
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return StateBatch.build(qsl, slots, fresh, "cpu")


def garbage_states(*shape: int) -> torch.Tensor:
    """Large random states, with a NaN in every slot no running request reads: what a fresh
    request must not read, and an untouched slot must keep."""
    states = torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 100
    read = [s for s, f in zip(NATIVE_SLOTS, NATIVE_FRESH) if not f]
    states.view(shape[0], -1)[[s for s in range(shape[0]) if s not in read], 3] = float("nan")
    return states


def assert_untouched(after: torch.Tensor, before: torch.Tensor, used: list[int]) -> None:
    others = [s for s in range(len(before)) if s not in used]
    torch.testing.assert_close(after[others], before[others], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernels", BUILDS)
@pytest.mark.parametrize(
    ("k_heads", "v_heads", "k_dim", "v_dim"),
    # Heads narrower than the kernel's block of 128 columns (all column by column), wider
    # with a remainder (136), and the model's 128 x 128; two v heads a key head, and one.
    [(2, 4, 16, 8), (1, 2, 24, 136), (2, 2, 128, 128)],
)
def test_native_decode_step_equals_the_torch_step(
    kernels: str, k_heads: int, v_heads: int, k_dim: int, v_dim: int
) -> None:
    native = build(kernels)
    assert native is not None
    batch = mixed_batch(NATIVE_LENGTHS, NATIVE_SLOTS, NATIVE_FRESH)
    gen = torch.Generator().manual_seed(8)
    t = batch.num_tokens
    # v a strided view of a wider projection, as the layer's split of its channels gives it.
    v = torch.randn(t, v_heads * v_dim + 5, generator=gen)[:, 5:].view(t, v_heads, v_dim)
    inputs = (
        torch.randn(t, k_heads, k_dim, generator=gen),
        torch.randn(t, k_heads, k_dim, generator=gen),
        v,
        -torch.rand(t, v_heads, generator=gen) * 2,
        torch.rand(t, v_heads, generator=gen),
    )
    before = garbage_states(NATIVE_NUM_SLOTS, v_heads, k_dim, v_dim)
    want_state, got_state = before.clone(), before.clone()
    want = gated_delta_rule(*inputs, want_state, batch)
    got = gated_delta_rule(*inputs, got_state, batch, native)
    assert_close(got, want, 1e-6)
    assert_close(got_state[NATIVE_SLOTS], want_state[NATIVE_SLOTS], 1e-6)
    assert_untouched(got_state, before, NATIVE_SLOTS)


@pytest.mark.parametrize("kernels", BUILDS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
# Channels a whole number of vector blocks, and 100: a partial last block. K = 4 (Qwen's),
# 2 (a state of one input) and 6 (wider than two rows of a request).
@pytest.mark.parametrize(("channels", "taps"), [(96, 4), (100, 4), (100, 2), (100, 6)])
def test_native_conv_equals_the_torch_conv(
    kernels: str, with_bias: bool, channels: int, taps: int
) -> None:
    native = build(kernels)
    assert native is not None
    batch = mixed_batch(NATIVE_LENGTHS, NATIVE_SLOTS, NATIVE_FRESH)
    gen = torch.Generator().manual_seed(9)
    t = batch.num_tokens
    x = torch.randn(t, channels + 3, generator=gen)[:, 3:]  # rows strided
    weight = torch.randn(channels, taps, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    before = garbage_states(NATIVE_NUM_SLOTS, channels, taps - 1)
    want_state, got_state = before.clone(), before.clone()
    # Twice: the second step reads the states the first left (a decode's shift included).
    for _ in range(2):
        want = causal_conv1d(x, weight, bias, want_state, batch)
        got = causal_conv1d(x, weight, bias, got_state, batch, native)
        assert_close(got, want, 1e-6)
        torch.testing.assert_close(got_state, want_state, rtol=0, atol=0, equal_nan=True)
    assert_untouched(got_state, before, NATIVE_SLOTS)


@pytest.mark.parametrize("kernels", BUILDS)
def test_native_kernels_refuse_a_slot_outside_the_states(kernels: str) -> None:
    native = build(kernels)
    assert native is not None
    batch = mixed_batch([1, 2], [0, 3], [False, False])
    state, conv_state = torch.zeros(3, 2, 4, 4), torch.zeros(3, 8, 3)
    with pytest.raises(IndexError):
        causal_conv1d(torch.ones(3, 8), torch.ones(8, 4), None, conv_state, batch, native)
    batch = mixed_batch([1, 2], [3, 0], [False, False])
    with pytest.raises(IndexError):
        gated_delta_rule(
            *(torch.ones(3, 2, 4) for _ in range(3)),
            torch.zeros(3, 2),
            torch.ones(3, 2),
            state,
            batch,
            native,
        )
    assert not conv_state.any() and not state.any()
