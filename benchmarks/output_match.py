"""Is an engine's output with kvtier the output of an engine that computed everything itself?

An output is the greedy tokens of a request and, per generated token, the log-probabilities the
engine reported for its top-k candidates (and the chosen token). Two outputs match when they have
at least ``MIN_COMPARED_TOKENS`` tokens, the same tokens, and every log-probability both report
for the same candidate at the same position differs by at most the tolerance of the model's dtype.
A candidate that one side ranks in its top-k and the other does not counts with the smallest
difference it can have: how far it would have to move to enter the other side's list.

Tolerances (``LOGPROB_TOLERANCE``): identical KV computed by the same kernels gives identical
log-probabilities; what may differ is the computation around it (a suffix computed after a
reused prefix instead of one pass over the whole prompt). With the project's model recipe
(``kvtier.engine.models``) that moves float32 log-probabilities by about 1e-5, while the KV of
another document, or zeroed KV, changes the tokens from the first one on and moves the
log-probabilities by more than 1 (tests/engines/vllm_engine has the control that shows it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The fewest generated tokens a comparison rests on.
MIN_COMPARED_TOKENS = 32
#: Largest log-probability difference that still counts as the same output, by model dtype:
#: bfloat16 keeps 8 significant bits, and over 12 layers a suffix computed after a reused prefix
#: rounds differently from one pass: by up to 0.03 in ``kvtier bench e2e`` (12 x 768 model).
LOGPROB_TOLERANCE: dict[str, float] = {"float32": 1e-3, "bfloat16": 1e-1, "float16": 2e-2}
#: Candidates per position whose log-probabilities are compared.
TOP_K = 5


@dataclass(slots=True, frozen=True)
class Generation:
    """One request's output: its tokens (ids or strings) and, per token, ``{candidate: logprob}``."""

    tokens: tuple[Any, ...]
    logprobs: tuple[Mapping[Any, float], ...]

    @classmethod
    def of(cls, tokens: Sequence[Any], logprobs: Sequence[Mapping[Any, float]] | None = None) -> Generation:
        return cls(tuple(tokens), tuple(dict(lp) for lp in (logprobs or ())))


@dataclass(slots=True, frozen=True)
class OutputMatch:
    """The comparison of one or more outputs with their references."""

    compared_tokens: int
    identical_tokens: bool
    max_logprob_diff: float
    tolerance: float
    #: ``(output, position)`` of the first token that differs, or None.
    first_difference: tuple[int, int] | None = None
    outputs: int = 1

    @property
    def ok(self) -> bool:
        return (self.identical_tokens and self.compared_tokens >= MIN_COMPARED_TOKENS * self.outputs
                and self.max_logprob_diff <= self.tolerance)

    def describe(self) -> str:
        where = "" if self.first_difference is None else f", first differing token at {self.first_difference}"
        return (f"{self.outputs} outputs, {self.compared_tokens} tokens compared, identical tokens "
                f"{self.identical_tokens}{where}, max logprob diff {self.max_logprob_diff:.3g} "
                f"(tolerance {self.tolerance:g})")

    def as_dict(self) -> dict[str, Any]:
        return {"compared_tokens": self.compared_tokens, "identical_tokens": self.identical_tokens,
                "max_logprob_diff": _finite(self.max_logprob_diff), "logprob_tolerance": self.tolerance,
                "first_difference": self.first_difference, "outputs": self.outputs, "ok": self.ok}


def compare(reference: Generation, candidate: Generation, tolerance: float) -> OutputMatch:
    """Compare ``candidate`` with ``reference``, position by position up to the first differing token."""
    n = min(len(reference.tokens), len(candidate.tokens))
    first = next((i for i in range(n) if reference.tokens[i] != candidate.tokens[i]), None)
    if first is None and len(reference.tokens) != len(candidate.tokens):
        first = n
    upto = n if first is None else first + 1  # the position where they part still has comparable logprobs
    diff = 0.0
    for i in range(min(upto, len(reference.logprobs), len(candidate.logprobs))):
        diff = max(diff, _position_diff(reference.logprobs[i], candidate.logprobs[i]))
    have_logprobs = len(reference.logprobs) >= upto and len(candidate.logprobs) >= upto
    return OutputMatch(compared_tokens=n, identical_tokens=first is None,
                       max_logprob_diff=diff if have_logprobs else math.inf, tolerance=tolerance,
                       first_difference=None if first is None else (0, first))


def combine(matches: Iterable[OutputMatch]) -> OutputMatch:
    """Many comparisons as one: every output must match."""
    ms = list(matches)
    if not ms:
        raise ValueError("combine: no comparisons")
    first = next(((k, m.first_difference[1]) for k, m in enumerate(ms) if m.first_difference is not None), None)
    return OutputMatch(compared_tokens=sum(m.compared_tokens for m in ms),
                       identical_tokens=all(m.identical_tokens for m in ms),
                       max_logprob_diff=max(m.max_logprob_diff for m in ms), tolerance=min(m.tolerance for m in ms),
                       first_difference=first, outputs=sum(m.outputs for m in ms))


def top_logprobs(logits: Any, k: int = TOP_K) -> dict[int, float]:
    """The ``k`` most likely next tokens of one position's logits (a torch tensor) and their
    log-probabilities, computed in float32."""
    import torch

    lp = torch.log_softmax(logits.detach().float().reshape(-1), dim=-1)
    values, ids = lp.topk(k)
    return {int(i): float(v) for i, v in zip(ids, values, strict=True)}


def first_step_diff(reference_logits: Any, logits: Any, k: int = TOP_K) -> float:
    """The largest log-probability difference over the top-``k`` candidates of either side for one
    position (the first generated token), as ``compare`` judges each position."""
    return _position_diff(top_logprobs(reference_logits, k), top_logprobs(logits, k))


def _position_diff(a: Mapping[Any, float], b: Mapping[Any, float]) -> float:
    """The largest difference over the candidates of one position (see the module docstring)."""
    if not a or not b:
        return math.inf
    diff = 0.0
    for one, other in ((a, b), (b, a)):
        floor = min(other.values())  # the other side's k-th candidate
        for tok, lp in one.items():
            # A candidate missing on the other side has at most the other side's k-th logprob there.
            diff = max(diff, abs(lp - other[tok]) if tok in other else lp - floor)
    return diff


def _finite(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else round(x, 8)
