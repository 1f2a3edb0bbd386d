"""Sampler behaviour against independent NumPy/PyTorch computations on the logits."""

import numpy as np
import pytest
import torch

from weir.services.executor import sampler
from weir.services.executor.input_batch import token_bitmask
from weir.services.executor.sampler import (
    Penalties,
    Sampler,
    SamplingBatch,
    apply_penalties_,
    apply_top_k_top_p,
    draw_by_inverse_cdf,
    draw_by_race,
)
from weir.shared.sampling import SamplingParams

VOCAB = 50


def make_batch(rows: list[dict], **kwargs) -> SamplingBatch:
    def col(key, default, dtype):
        return np.array([r.get(key, default) for r in rows], dtype=dtype)

    seeds = [
        (i, r["seed"], r.get("pos", 0)) for i, r in enumerate(rows) if r.get("seed") is not None
    ]
    return SamplingBatch.build(
        col("temperature", 1.0, np.float32),
        col("top_k", 0, np.int64),
        col("top_p", 1.0, np.float32),
        col("min_p", 0.0, np.float32),
        device="cpu",
        seeds=seeds,
        **kwargs,
    )


def random_logits(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed))


def allowed_set(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Tokens that survive temperature -> min-p -> top-k -> top-p, computed in float64."""
    x = logits.astype(np.float64) / temperature
    alive = np.ones_like(x, dtype=bool)
    if min_p > 0:
        p = np.exp(x - x.max())
        alive &= p >= min_p * p.max()
    if top_k > 0:
        kth = np.sort(x[alive])[::-1][min(top_k, alive.sum()) - 1]
        alive &= x >= kth
    if top_p < 1:
        idx = np.flatnonzero(alive)
        p = np.exp(x[idx] - x[idx].max())
        p /= p.sum()
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]
        alive = np.zeros_like(alive)
        alive[idx[keep]] = True
    return set(np.flatnonzero(alive).tolist())


def test_temperature_zero_is_argmax_even_in_a_mixed_batch():
    logits = random_logits(8, seed=0)
    rows = [{"temperature": 0.0 if i % 2 == 0 else 0.9, "top_k": 3} for i in range(8)]
    out = Sampler(seed=0)(logits, make_batch(rows))
    greedy = torch.arange(0, 8, 2)
    assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(dim=-1))
    all_greedy = make_batch([{"temperature": 0.0}] * 8)
    assert all_greedy.all_greedy and all_greedy.temperature is None  # nothing to copy
    assert torch.equal(Sampler(seed=0)(logits, all_greedy).token_ids, logits.argmax(dim=-1))


def test_greedy_rows_take_the_first_of_tied_maxima_and_a_nan_as_numpy_does():
    """Ties (bf16 logits have many) and NaNs decide as NumPy's argmax: the first maximum, the
    first NaN."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 1000), generator=gen).float()
    logits[::3][torch.rand(22, 1000, generator=gen) < 0.002] = float("nan")
    logits[5] = float("-inf")
    assert logits.isnan().any(dim=1).sum() > 10
    got = Sampler(seed=0)(logits, make_batch([{"temperature": 0.0}] * 64)).token_ids
    assert torch.equal(got, torch.from_numpy(logits.numpy().argmax(axis=-1)))


def test_extreme_temperatures_neither_overflow_nor_stick_to_token_zero():
    # A denormal temperature made every logit inf (NaN probabilities: token 0 forever):
    # SamplingParams makes it greedy. A temperature beyond float32 made them NaN; it stays
    # finite (near uniform).
    logits = random_logits(8, seed=4)
    logits[:, 0] = logits.min() - 1  # token 0 is never the argmax
    tiny = [{"temperature": SamplingParams(temperature=t).temperature} for t in (1e-45, 1e-6)]
    out = Sampler(seed=0)(logits, make_batch(tiny * 4))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    hot = Sampler(seed=0)(
        logits.repeat(64, 1),
        SamplingBatch.build(
            np.full(512, 1e300),
            np.zeros(512, np.int64),
            np.ones(512, np.float32),
            np.zeros(512, np.float32),
            device="cpu",
        ),
    )
    assert len(set(hot.token_ids.tolist())) > VOCAB // 2


def test_seeded_rows_do_not_depend_on_batch_composition():
    logits = random_logits(1, seed=1, scale=0.5)  # flat-ish, so draws really vary
    seeded = [
        {"seed": seed, "pos": pos, "temperature": 1.0}
        for seed in (0, 7, 2**40)
        for pos in range(12)
    ]
    alone = [
        Sampler(seed=s)(logits, make_batch([row])).token_ids.item() for s, row in enumerate(seeded)
    ]
    assert len(set(alone)) > 4, "seeded draws should differ across positions"

    # The same rows inside batches with unseeded rows, filtering rows and greedy rows around them.
    neighbours = [
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 0.0},
        {"temperature": 1.3, "top_p": 0.5},
    ]
    rows, row_logits, where = [], [], []
    for i, row in enumerate(seeded):
        for j in range(i % 3):
            rows.append(neighbours[j])
            row_logits.append(random_logits(1, seed=100 + i * 3 + j))
        where.append(len(rows))
        rows.append(row)
        row_logits.append(logits)
    mixed = Sampler(seed=123)(torch.cat(row_logits), make_batch(rows)).token_ids[where].tolist()
    assert mixed == alone


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 0.6, "top_p": 0.7},
        {"temperature": 1.5, "min_p": 0.2},
        {"temperature": 1.2, "top_k": 10, "top_p": 0.8, "min_p": 0.05},
        {"temperature": 1.0, "top_k": 1},
    ],
)
def test_filters_never_emit_a_token_outside_the_allowed_set(params):
    base = random_logits(4, seed=2)
    draws = 300
    logits = base.repeat_interleave(draws, dim=0)
    rows = [dict(params, **({"seed": i} if i % 2 else {})) for i in range(len(logits))]
    tokens = Sampler(seed=5)(logits, make_batch(rows)).token_ids.view(4, draws)
    for r in range(4):
        allowed = allowed_set(
            base[r].numpy(),
            params["temperature"],
            params.get("top_k", 0),
            params.get("top_p", 1.0),
            params.get("min_p", 0.0),
        )
        seen = set(tokens[r].tolist())
        assert seen <= allowed, (seen - allowed, allowed)
        if len(allowed) > 1:
            assert len(seen) > 1


def test_unfiltered_sampling_follows_the_softmax_distribution():
    vocab_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (VOCAB - 5)])
    draws = 6000
    rows = [{"temperature": 0.8}] * draws
    tokens = Sampler(seed=9)(vocab_logits.repeat(draws, 1), make_batch(rows)).token_ids
    freq = torch.bincount(tokens, minlength=VOCAB).float() / draws
    expected = torch.softmax(vocab_logits[0] / 0.8, dim=-1)
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize("candidates", [12, 1024])
def test_filters_keep_exactly_the_reference_set_with_or_without_the_full_sort(
    candidates, monkeypatch
):
    # On a CPU top-k and top-p first look at the largest logits only, and fall back to the
    # full sort where a row's filters may keep one past them (here: top-k 20, or a wide
    # nucleus): each row alone and all together run both paths.
    monkeypatch.setattr(sampler, "CPU_FILTER_CANDIDATES", candidates)
    rows = [
        {"top_k": 3},
        {"top_p": 0.5},
        {"top_p": 0.95},
        {"top_k": 8, "top_p": 0.6},
        {"top_k": 0, "top_p": 1.0},  # not filtered, beside rows that are
        {"top_k": 20, "top_p": 0.3},
        {"top_k": 1},
        {"top_p": 1e-300},  # 0 in float32: the likeliest token still survives
    ]
    top_k = torch.tensor([r.get("top_k", 0) for r in rows])
    top_p = torch.tensor([r.get("top_p", 1.0) for r in rows])
    for seed in range(6):
        logits = random_logits(len(rows), seed=50 + seed, scale=1.0 + seed)
        together = apply_top_k_top_p(logits, top_k, top_p)
        for i, row in enumerate(rows):
            alone = apply_top_k_top_p(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])[0]
            expected = allowed_set(
                logits[i].numpy(), 1.0, row.get("top_k", 0), row.get("top_p", 1.0), 0.0
            )
            for kept in (together[i], alone):
                finite = kept.isfinite()
                assert set(torch.nonzero(finite).flatten().tolist()) == expected, (seed, row)
                assert torch.equal(kept[finite], logits[i][finite])
    # The candidates alone decide some rows here (a sort would hide a broken shortcut).
    _, unsure = sampler._filter_candidates(logits, top_k, top_p)
    assert not unsure[0] and not unsure[6]


def test_ties_at_the_kth_logit_are_kept_past_the_candidates(monkeypatch):
    monkeypatch.setattr(sampler, "CPU_FILTER_CANDIDATES", 2)
    logits = torch.tensor([[5.0, 3.0, 1.0, 3.0, 3.0, 3.0, 0.0, -1.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.nonzero(kept[0].isfinite()).flatten().tolist() == [0, 1, 3, 4, 5]


# The GPU's draw and the CPU's, each run here.
DRAWS = pytest.mark.parametrize("draw", [draw_by_race, draw_by_inverse_cdf])


@DRAWS
def test_each_draw_follows_the_probabilities_and_never_draws_an_impossible_token(draw):
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])  # zeros first, between and last
    rows = 20_000
    tokens = draw(probs.repeat(rows, 1), torch.Generator().manual_seed(0), {})
    freq = torch.bincount(tokens, minlength=len(probs)).float() / rows
    assert not freq[[0, 2, 5]].any()
    assert (freq - probs).abs().max() < 0.015  # about 4 standard deviations


@DRAWS
def test_a_seeded_rows_draw_is_its_generators_alone(draw):
    probs = torch.softmax(random_logits(5, seed=3, scale=0.5), dim=-1)
    seeded = [
        draw(probs[2:3], torch.Generator().manual_seed(s), {0: torch.Generator().manual_seed(7)})
        for s in range(3)
    ]
    mixed = draw(probs, torch.Generator().manual_seed(99), {2: torch.Generator().manual_seed(7)})
    assert {int(t) for t in seeded} == {int(mixed[2])}
    others = {tuple(draw(probs, torch.Generator().manual_seed(s), {}).tolist()) for s in range(8)}
    assert len(others) > 1  # unseeded rows follow the shared generator


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(6, seed=3)
    rows = [{"temperature": t, "top_k": 4} for t in (0.0, 0.5, 1.0, 2.0, 0.0, 1.0)]
    out = Sampler(seed=1)(logits, make_batch(rows, num_logprobs=3))
    ref = torch.log_softmax(logits.double(), dim=-1)
    chosen = out.token_ids
    torch.testing.assert_close(
        out.logprobs.token_logprobs.double(), ref.gather(1, chosen[:, None])[:, 0]
    )
    ref_top, ref_ids = ref.topk(3, dim=-1)
    assert torch.equal(out.logprobs.top_ids, ref_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs.double(), ref_top)


def test_banned_tokens_are_never_produced():
    logits = random_logits(4, seed=4)
    top2 = logits.topk(2, dim=-1).indices
    banned = [(r, [top2[r, 0].item()]) for r in range(4)]
    greedy = Sampler(seed=0)(
        logits, make_batch([{"temperature": 0.0}] * 4, banned=banned)
    ).token_ids
    assert torch.equal(greedy, top2[:, 1])
    many = logits.repeat_interleave(100, dim=0)
    banned_many = [(r, [top2[r // 100, 0].item()]) for r in range(400)]
    sampled = Sampler(seed=0)(
        many, make_batch([{"temperature": 1.0}] * 400, banned=banned_many)
    ).token_ids
    assert not (sampled.view(4, 100) == top2[:, :1]).any()


def test_penalties_follow_openais_definition_token_by_token():
    """Against a loop over each row's tokens in float64: repetition (prompt or output) divides
    a positive logit and multiplies a negative one, then presence once and frequency per
    occurrence in the output are subtracted; rows without penalties are left as they were."""
    rng = np.random.default_rng(5)
    logits = random_logits(5, seed=5)
    rows = [0, 2, 3]
    presence, frequency, repetition = [0.5, -1.0, 2.0], [0.25, 0.0, -2.0], [1.5, 1.0, 0.5]
    outputs = [rng.integers(0, VOCAB, n).tolist() for n in (7, 0, 30)]
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 9, 0)]

    def pairs(lists):
        return tuple(
            torch.tensor(v, dtype=torch.int64)
            for v in ([i for i, t in enumerate(lists) for _ in t], [x for t in lists for x in t])
        )

    penalties = Penalties(
        rows=torch.tensor(rows),
        presence=torch.tensor(presence),
        frequency=torch.tensor(frequency),
        repetition=torch.tensor(repetition),
        output=pairs(outputs),
        prompt=pairs(prompts),
    )
    got = logits.clone()
    apply_penalties_(got, penalties)
    want = logits.double().clone()
    for i, row in enumerate(rows):
        for token in set(outputs[i]) | set(prompts[i]):
            x = want[row, token]
            want[row, token] = x / repetition[i] if x > 0 else x * repetition[i]
        for token in set(outputs[i]):
            want[row, token] -= presence[i] + frequency[i] * outputs[i].count(token)
    torch.testing.assert_close(got.double(), want)
    assert not torch.equal(got[rows], logits[rows])


def test_biases_and_penalties_change_the_choice_but_not_the_logprobs():
    logits = random_logits(3, seed=6)
    top = logits.argmax(dim=-1)
    last = logits.argmin(dim=-1)
    bias = [(r, np.array([int(last[r])]), np.array([100.0], np.float32)) for r in range(3)]
    out = Sampler(seed=0)(
        logits, make_batch([{"temperature": 0.0}] * 3, num_logprobs=2, logit_bias=bias)
    )
    assert torch.equal(out.token_ids, last)  # +100 lifts the least likely token to the top
    penalties = Penalties(
        rows=torch.tensor([1]),
        presence=torch.tensor([2.0]),
        frequency=torch.tensor([2.0]),
        repetition=torch.tensor([1.0]),
        output=(torch.zeros(10, dtype=torch.int64), top[1:2].repeat(10)),
        prompt=None,
    )
    out = Sampler(seed=0)(
        logits, make_batch([{"temperature": 0.0}] * 3, num_logprobs=2, penalties=penalties)
    )
    assert out.token_ids[1] != top[1] and torch.equal(out.token_ids[[0, 2]], top[[0, 2]])
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs.top_logprobs, raw.topk(2, dim=-1).values)


def test_logprobs_see_a_structured_outputs_mask_and_nothing_after_it():
    """vLLM masks the logits with the grammar's bitmask before its sampler, which takes the
    logprobs first: a forbidden token is -inf (written -9999.0, as vLLM's API does), the
    others renormalised over what the grammar allows; allowed_token_ids, like biases, act
    after the logprobs."""
    logits = random_logits(2, seed=8)
    grammar_ids = logits[0].topk(6).indices[3:].tolist()  # not the three likeliest
    grammar = token_bitmask(tuple(grammar_ids), VOCAB)
    only = token_bitmask(tuple(grammar_ids[:2]), VOCAB)  # allowed_token_ids, on both rows
    both = (np.frombuffer(grammar, "<i4") & np.frombuffer(only, "<i4")).tobytes()
    batch = make_batch(
        [{"temperature": 0.0}] * 2,
        num_logprobs=4,
        allowed=[(0, both), (1, only)],
        grammar=[(0, grammar)],
    )
    out = Sampler(seed=0)(logits, batch)
    assert out.token_ids.tolist() == [
        max(grammar_ids[:2], key=lambda t: logits[0, t]),
        max(grammar_ids[:2], key=lambda t: logits[1, t]),
    ]
    masked = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
    masked[grammar_ids] = logits[0, grammar_ids].double()
    want = torch.log_softmax(masked, -1)
    top = want.topk(3).values.tolist() + [sampler.MIN_LOGPROB]  # three allowed, then none
    assert out.logprobs.top_logprobs[0].tolist() == pytest.approx(top, abs=1e-5)
    assert out.logprobs.token_logprobs[0].item() == pytest.approx(
        want[out.token_ids[0]].item(), abs=1e-5
    )
    raw = torch.log_softmax(logits[1].double(), -1)  # allowed_token_ids alone: raw
    assert out.logprobs.top_logprobs[1].tolist() == pytest.approx(
        raw.topk(4).values.tolist(), abs=1e-5
    )


def test_a_tokens_rank_counts_the_tokens_at_least_as_likely_as_vllms():
    """A tie ranks each of its tokens last among them (vLLM counts logits >= the token's)."""
    logits = torch.tensor([[1.0, 1.0, 0.5, 2.0]] * 4)
    ranks = sampler.token_ranks(logits, torch.tensor([3, 0, 1, 2]))
    assert ranks.tolist() == [1, 3, 3, 4]
