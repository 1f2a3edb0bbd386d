"""The n-gram (prompt-lookup) proposer against a brute-force search."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.services.engine.ngram import MAX_NGRAM_LENGTHS, NgramProposer, make_proposer
from weir.services.scheduler import Request
from weir.shared.config import EngineArgs


def brute_force(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix n-gram's latest earlier occurrence, and the k tokens after it."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def decoding(rid: str, tokens: list[int]) -> Request:
    request = Request(rid, tokens)
    request.num_computed_tokens = len(tokens) - 1
    return request


def test_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(k=3, n_min=1, n_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7]
    # (5, 6, 7) occurred at 0..2 -> 8, 9, 6; the shorter (6, 7) later at 5..6 loses.
    assert proposer.propose([decoding("a", tokens)]) == {"a": [8, 9, 6]}
    assert proposer.propose([decoding("b", [1, 2, 3])]) == {}  # nothing repeats
    partial = Request("c", [4, 4, 4, 4])  # prefill not done: no decode next step
    assert proposer.propose([partial]) == {}


def test_a_new_request_with_an_ended_ones_id_starts_a_new_index():
    """Nothing ran between the two (a stop string ended the first while the loop was idle):
    the first's n-grams must not draft for the second."""
    proposer = NgramProposer(k=2, n_min=1, n_max=2)
    proposer.propose([decoding("r", [9, 1, 2, 9])])
    tokens = [9, 9, 1, 2]
    assert proposer.propose([decoding("r", tokens)]).get("r", []) == brute_force(tokens, 2, 1, 2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), max_size=8),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_incremental_index_equals_brute_force(prompt, appended, k, n_min, extra):
    n_max = n_min + extra
    proposer = NgramProposer(k, n_min, n_max)
    tokens = list(prompt)
    assert proposer.propose([decoding("r", tokens)]).get("r", []) == brute_force(
        tokens, k, n_min, n_max
    )
    for chunk in appended:  # a step appends one token, or several accepted drafts
        tokens += chunk
        assert proposer.propose([decoding("r", tokens)]).get("r", []) == brute_force(
            tokens, k, n_min, n_max
        )


def test_a_long_n_max_matches_as_the_longest_length_the_map_holds():
    """n-grams of up to MAX_NGRAM_LENGTHS lengths are kept (each length costs a key of that
    many tokens per position: 256 lengths took a 4k-token prompt 3 s and 1 GB)."""
    passage = list(range(100, 140))
    tokens = passage + [1, 1, 1, 1] + passage[-20:] + [2, 2, 2, 2] + passage
    proposer = NgramProposer(k=4, n_min=1, n_max=256)
    assert proposer.n_max == MAX_NGRAM_LENGTHS
    drafts = proposer.propose([decoding("r", tokens)])
    assert drafts == {"r": brute_force(tokens, 4, 1, MAX_NGRAM_LENGTHS)}
    assert drafts == {"r": [2, 2, 2, 2]}  # the latest 16 tokens' match, not the first 40's
    assert brute_force(tokens, 4, 1, 256) == [1, 1, 1, 1]
    [index] = proposer._indexes.values()
    assert len(index.after) <= MAX_NGRAM_LENGTHS * len(tokens)


def test_options_are_checked():
    assert make_proposer(EngineArgs()) is None
    assert make_proposer(EngineArgs(speculative_method="ngram", num_speculative_tokens=4)).k == 4
    for bad in (
        EngineArgs(speculative_method="ngram"),
        EngineArgs(num_speculative_tokens=2),
    ):
        try:
            make_proposer(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
    with pytest.raises(ValueError, match="ngram_max .* is less than ngram_min"):
        EngineArgs(speculative_method="ngram", num_speculative_tokens=2, ngram_min=3, ngram_max=2)
