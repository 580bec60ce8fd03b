"""benchmarks.output_match: when two engine outputs count as the same."""

from __future__ import annotations

import math

import pytest

from benchmarks.output_match import MIN_COMPARED_TOKENS, Generation, combine, compare, first_step_diff

N = MIN_COMPARED_TOKENS


def gen(tokens: list[int], shift: float = 0.0, at: int | None = None) -> Generation:
    """Tokens with top-3 logprobs per position; ``shift`` moves the logprobs of position ``at`` (all if None)."""
    lps = []
    for i, t in enumerate(tokens):
        d = shift if at is None or at == i else 0.0
        lps.append({t: -0.5 + d, t + 1: -1.5 + d, t + 2: -3.0 + d})
    return Generation.of(tokens, lps)


def test_identical_outputs_match() -> None:
    m = compare(gen(list(range(N))), gen(list(range(N))), 1e-3)
    assert m.ok and m.identical_tokens and m.compared_tokens == N and m.max_logprob_diff == 0.0
    assert m.first_difference is None


def test_a_different_token_fails_and_says_where() -> None:
    other = list(range(N))
    other[5] = 999
    m = compare(gen(list(range(N))), gen(other), 1e-3)
    assert not m.ok and not m.identical_tokens and m.first_difference == (0, 5)


def test_logprobs_beyond_the_tolerance_fail_within_it_pass() -> None:
    ref = gen(list(range(N)))
    assert compare(ref, gen(list(range(N)), 5e-4, at=7), 1e-3).ok
    m = compare(ref, gen(list(range(N)), 2e-3, at=7), 1e-3)
    assert not m.ok and m.identical_tokens and m.max_logprob_diff == pytest.approx(2e-3)


def test_a_candidate_missing_on_one_side_counts_with_its_least_possible_difference() -> None:
    toks = list(range(N))
    ref = gen(toks)
    swapped = [dict(p) for p in ref.logprobs]
    # Position 0: the third candidate leaves the list, a token at -2.0 enters it; the missing one had
    # -3.0 on the reference side, so it may well sit below -2.0 on the other: no difference forced.
    del swapped[0][2]
    swapped[0][77] = -2.0
    m = compare(ref, Generation.of(toks, swapped), 1e-3)
    # ...but the entering token (-2.0) is not in the reference's list, whose floor is -3.0: >= 1.0.
    assert m.max_logprob_diff == pytest.approx(1.0) and not m.ok


def test_too_few_tokens_or_no_logprobs_never_pass() -> None:
    short = gen(list(range(N - 1)))
    assert not compare(short, short, 1e-3).ok
    bare = Generation.of(list(range(N)))
    m = compare(bare, bare, 1e-3)
    assert not m.ok and math.isinf(m.max_logprob_diff) and m.as_dict()["max_logprob_diff"] is None


def test_a_longer_candidate_is_a_difference() -> None:
    assert not compare(gen(list(range(N))), gen(list(range(N + 1))), 1e-3).identical_tokens


def test_combine_needs_every_output_to_match() -> None:
    good = compare(gen(list(range(N))), gen(list(range(N))), 1e-3)
    bad = compare(gen(list(range(N))), gen(list(range(N)), 0.1, at=3), 1e-3)
    both = combine([good, bad])
    assert both.outputs == 2 and both.compared_tokens == 2 * N and not both.ok
    assert both.max_logprob_diff == pytest.approx(0.1)
    assert combine([good, good]).ok
    with pytest.raises(ValueError):
        combine([])


def test_first_step_diff_compares_the_top_candidates_in_float32() -> None:
    import torch

    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0], dtype=torch.bfloat16)
    assert first_step_diff(logits, logits) == 0.0
    shifted = logits.float().clone()
    shifted[0] += 0.25  # the top candidate moves; every log-probability moves with the normaliser
    d = first_step_diff(logits, shifted)
    assert 0.1 < d < 0.25
    assert first_step_diff(logits, -logits) > 3  # another ranking entirely
