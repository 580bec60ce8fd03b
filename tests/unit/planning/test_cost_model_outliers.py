"""One slow request cannot fool the cost model, and a plan abandoned on bad evidence comes back.

The replay follows issue 31's first `make run`: two tenants ask about a 4,000-token public
document through the daemon (250 cached blocks of the ``small`` model, 100 question tokens); the
first reload after start-up took 1,092 ms against about 110 ms for every later one, the model
then predicted ~985 ms for every reload and stopped reloading. Each test runs the same sequence
against a control (a plain moving-average update, or re-probing switched off) that shows the
sequence really is a trap.
"""

from __future__ import annotations

import math

import pytest

from kvtier.engine.models import model_spec
from kvtier.errors import ConfigError
from kvtier.planning.cost_model import CostModel
from kvtier.planning.plans import Plan
from kvtier.planning.profiles import HostToDeviceProfile, PrefillProfile, TierProfile
from kvtier.store.lookup import Lookup, TierRun

LAYOUT = model_spec("small").layout()  # 2 KiB of KV per token
TIER = "daemon/memory"
DOC_BLOCKS = 250  # 4,000 tokens
QUESTION = 100
NBYTES = DOC_BLOCKS * LAYOUT.bytes_per_block
# What the replayed requests really cost (seconds): a reload's transfer, the copy into the model's
# cache, the question's prefill after the document, and the whole prompt from scratch.
TRANSFER_S = 0.020
ASSEMBLE_S = 0.004
TAIL_S = 0.090
FULL_S = 0.850


def prefill() -> PrefillProfile:
    """A CPU engine like the main job's: about 95 ms for the question after the document, 830 ms
    for the whole prompt from scratch (what the start-up probe measured)."""
    return PrefillProfile(5e-3, 150e-6, 2.5e-8, 1.6e-5)


def tier_prior() -> tuple[float, float]:
    return (1e-3, 5e8)  # benchmarks.e2e's prior for a daemon's memory tier: about 17 ms here


def lookup() -> Lookup:
    return Lookup((TierRun(0, TIER, 0, DOC_BLOCKS),), DOC_BLOCKS)


class MovingAverageTier(TierProfile):
    """The control: a plain moving average (weight 0.5) of observed / predicted time scales the
    prior; every observation moves it, outliers included."""

    def __init__(self) -> None:
        super().__init__(TIER, *tier_prior())
        self.scale = 1.0

    def observe(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.scale += 0.5 * (seconds / super().predict(blocks, nbytes) - self.scale)

    def coefficients(self) -> tuple[float, float, float]:
        lat, pb, spb = super().coefficients()
        return lat * self.scale, pb * self.scale, spb * self.scale

    def predict(self, blocks: int, nbytes: int) -> float:
        return super().predict(blocks, nbytes) * self.scale


def model(tier: TierProfile | None = None, **kw: object) -> CostModel:
    return CostModel(prefill(), {TIER: tier or TierProfile(TIER, *tier_prior())},
                     host_to_device=HostToDeviceProfile(2e9), **kw)  # type: ignore[arg-type]


def jitter(i: int) -> float:
    """A deterministic +-10 % spread, so the replay does not feed identical numbers."""
    return 1.0 + 0.1 * math.sin(1.7 * i)


def serve(cm: CostModel, i: int, transfer_s: float) -> Plan:
    """Plan request ``i`` and feed back what executing the chosen plan measured (as the
    transformers connector and the store do): the transfer of a non-overlapped reload, the
    assembly, and the prefill of what was computed."""
    plan = cm.plan(lookup(), QUESTION, LAYOUT)
    opt = plan.chosen
    if opt.load and not opt.overlapped:
        cm.observe_transfer(TIER, opt.load_blocks, opt.load_blocks * LAYOUT.bytes_per_block, transfer_s)
        cm.observe_assemble(opt.load_blocks * LAYOUT.bytes_per_block, ASSEMBLE_S * jitter(i))
    if opt.name == "full-reload":
        cm.observe_prefill(QUESTION, DOC_BLOCKS * 16, TAIL_S * jitter(i))
    elif opt.name == "full-recompute":
        cm.observe_prefill(DOC_BLOCKS * 16 + QUESTION, 0, FULL_S * jitter(i))
    return plan


def replay(cm: CostModel, first_transfer_s: float, requests: int = 12) -> list[Plan]:
    return [serve(cm, i, first_transfer_s if i == 0 else TRANSFER_S * jitter(i)) for i in range(requests)]


# -- one slow request -------------------------------------------------------------------------------
def test_the_priors_reproduce_the_issue_table() -> None:
    p = model().plan(lookup(), QUESTION, LAYOUT)
    assert p.name == "full-reload" and p.reason == "fastest"
    assert 100 < p.predicted_ms["full-reload"] < 130  # the table: 115 ms
    assert 800 < p.predicted_ms["full-recompute"] < 900  # the table: 830-888 ms


@pytest.mark.parametrize("first", [1.0, 0.3], ids=["first-reload-10x", "first-reload-3x"])
def test_a_slow_first_reload_does_not_change_the_decisions_after_it(first: float) -> None:
    """The first reload's transfer is 10x (or 3x) the whole TTFT of later ones; every later request
    stays on reload, and the prediction stays near what later reloads really cost."""
    cm = model()
    plans = replay(cm, first)
    assert plans[0].name == "full-reload"
    assert [p.name for p in plans[1:]] == ["full-reload"] * (len(plans) - 1)
    assert all(p.reason == "fastest" for p in plans)
    after = plans[1].predicted_ms["full-reload"]
    assert after < 1.5 * plans[0].predicted_ms["full-reload"]  # the outlier moved nothing
    truth_ms = (TRANSFER_S + ASSEMBLE_S + TAIL_S) * 1e3
    assert plans[-1].predicted_ms["full-reload"] == pytest.approx(truth_ms, rel=0.35)
    stats = cm.profile(TIER).describe()
    assert stats["held_back"] == 1 and stats["dropped"] == 1 and stats["resets"] == 0


def test_control_a_moving_average_takes_the_first_reload_as_the_truth() -> None:
    plans = replay(model(MovingAverageTier()), 1.0)
    assert plans[0].name == "full-reload"
    assert plans[1].name != "full-reload"  # the trap the test above guards against
    assert plans[1].predicted_ms["full-reload"] > 3 * plans[0].predicted_ms["full-reload"]


# -- a plan abandoned on bad evidence -----------------------------------------------------------------
def abandon(cm: CostModel) -> list[Plan]:
    """Two slow reloads in a row (a neighbour held the cores for two requests): that is evidence,
    and the model stops reloading; the tier is fast again from then on."""
    slow = 50 * TRANSFER_S
    plans = [serve(cm, 0, slow), serve(cm, 1, slow)]
    assert [p.name for p in plans] == ["full-reload", "full-reload"]
    return plans


def test_an_abandoned_plan_is_reprobed_and_comes_back_once_it_is_fast_again() -> None:
    cm = model(reprobe_after=16, reprobe_budget=0.02)
    plans = abandon(cm)
    plans += [serve(cm, i, TRANSFER_S * jitter(i)) for i in range(2, 40)]
    names = [p.name for p in plans]
    assert names[2] == "full-recompute"  # abandoned on the confirmed slow evidence
    probes = [i for i, p in enumerate(plans) if p.probe]
    assert probes, names
    first = probes[0]
    assert first >= 16  # not before reprobe_after decisions without it
    # The probe is visible: it says what it is and what the model believed best instead. It is
    # the stalest option within the budget: split at its best point reads all blocks but one.
    assert plans[first].reason == "probe" and plans[first].believed_best == "full-recompute"
    assert plans[first].chosen.load_blocks >= DOC_BLOCKS - 1 and not plans[first].chosen.overlapped
    # Its fast transfer is evidence at once: reload is the fastest plan again, for good (later
    # probes of the near-equal mixed plans are the bounded exploration, not a relapse).
    back = [p for p in plans[first + 1 :] if not p.probe]
    assert back and {p.name for p in back} == {"full-reload"} and {p.reason for p in back} == {"fastest"}
    assert plans[first + 1].predicted_ms["full-reload"] < 200
    assert cm.describe()["probes"] == len(probes)


def test_control_without_reprobing_the_abandoned_plan_never_comes_back() -> None:
    cm = model(reprobe_after=0)
    plans = abandon(cm)
    plans += [serve(cm, i, TRANSFER_S * jitter(i)) for i in range(2, 40)]
    assert {p.name for p in plans[2:]} == {"full-recompute"}
    assert not any(p.probe for p in plans)


# -- the exploration bound ----------------------------------------------------------------------------
def two_plans(reload_s: float, recompute_s: float, **kw: object) -> CostModel:
    """A model whose only options (one block: no mixed plan) are believed to take these times for
    a request of one new token: 17 tokens from scratch, or the one block read and one token."""
    per_token = recompute_s / (LAYOUT.block_tokens + 1)
    return CostModel(PrefillProfile(0.0, per_token, 0.0), {"t": TierProfile("t", reload_s - per_token, 1e15)},
                     host_to_device=HostToDeviceProfile(1e15), **kw)  # type: ignore[arg-type]


def first_probe(cm: CostModel, decisions: int = 400) -> int | None:
    lk = Lookup((TierRun(0, "t", 0, 1),), 1)
    for i in range(decisions):
        if cm.plan(lk, 1, LAYOUT).probe:
            return i
    return None


@pytest.mark.parametrize(("believed", "after"), [(1.1, 16), (1.49, 25), (2.99, 100)])
def test_a_plan_believed_k_times_slower_is_reprobed_after_k_minus_1_over_budget_decisions(
        believed: float, after: int) -> None:
    # Reload is believed ``believed`` times slower than the recompute the model chooses; the
    # prefill of the one token after the block is negligible against it.
    cm = two_plans(0.1 * believed, 0.1, reprobe_after=16, reprobe_budget=0.02)
    assert first_probe(cm) == after


def test_reprobing_can_be_switched_off_and_a_reported_run_counts_as_fresh_evidence() -> None:
    assert first_probe(two_plans(0.11, 0.1, reprobe_after=0)) is None
    cm = two_plans(0.11, 0.1, reprobe_after=16)
    lk = Lookup((TierRun(0, "t", 0, 1),), 1)
    for _ in range(40):  # a benchmark that runs every plan of every request
        plan = cm.plan(lk, 1, LAYOUT)
        assert not plan.probe
        cm.note_run(plan, "full-reload")
    with pytest.raises(KeyError, match="not applicable"):
        cm.note_run(plan, "split")


@pytest.mark.parametrize("kw", [{"reprobe_after": -1}, {"reprobe_budget": -0.1}, {"reprobe_budget": math.nan}])
def test_bad_reprobe_settings_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="reprobe"):
        CostModel(prefill(), {}, **kw)  # type: ignore[arg-type]
