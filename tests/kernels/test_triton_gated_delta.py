"""The Triton decode step of the gated delta rule against the PyTorch token mixer it stands in
for (`gated_delta_rule` on a batch of decodes), natively on a GPU, under the interpreter on
a CPU: every decode's output, its slot's new state, other slots untouched; fresh slots (NaN
in them) read as zero; value heads grouped by key head; a value head wider than a tile."""

import pytest
import torch

from weir.kernels.gated_delta_net import DecodeStep, StateBatch, gated_delta_rule, l2norm
from weir.kernels.triton_layers import TritonLayerKernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("k_heads", "v_heads", "k_dim", "v_dim"),
    [(2, 4, 16, 8), (1, 3, 8, 40)],
    ids=["grouped", "wide"],
)
def test_decodes_as_the_torch_path(k_heads, v_heads, k_dim, v_dim):
    gen = torch.Generator().manual_seed(0)
    slots, fresh = [4, 0, 6, 2, 5], [False, True, False, True, False]
    n = len(slots)
    q, k = (torch.randn(n, k_heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(n, v_heads, v_dim, generator=gen)
    g = -torch.rand(n, v_heads, generator=gen) * torch.linspace(0.01, 3.0, v_heads)
    beta = torch.rand(n, v_heads, generator=gen)
    state = torch.randn(8, v_heads, k_dim, v_dim, generator=gen)
    state[0, 1, 2, 3] = state[2, 0, 0, 0] = float("nan")  # the fresh slots' stale values
    want_state = state.clone()
    batch = StateBatch.build(list(range(n + 1)), slots, fresh, "cpu")
    want = gated_delta_rule(q, k, v, g, beta, want_state, batch)

    got_state = state.to(DEVICE)
    # The decodes' rows of a step of more rows (a prefill's first among them).
    rows = [1, 2, 3, 4, 5]
    q, k, v, g, beta = (torch.cat((t[:1], t)) for t in (q, k, v, g, beta))
    kernels = TritonLayerKernels()  # what a GatedDeltaNet on a GPU is given
    assert isinstance(kernels, DecodeStep)
    got = kernels.gated_delta_decode(
        *(t.to(DEVICE) for t in (l2norm(q) * k_dim**-0.5, l2norm(k), v, g, beta)),
        got_state,
        *(torch.tensor(i, device=DEVICE) for i in (rows, slots, [int(f) for f in fresh])),
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.cpu(), want_state, rtol=1e-5, atol=1e-5, equal_nan=True)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(got_state.cpu()[untouched], state[untouched])
