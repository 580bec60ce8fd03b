"""The router's settings reach its chooser (kvtier/router/app.py); a bad one is refused."""

from __future__ import annotations

import math

import pytest

from kvtier.errors import ConfigError
from kvtier.router.app import Router, RouterSettings
from kvtier.router.engines import EngineSpec
from kvtier.router.service_tail import QUANTILE

ENGINES = [EngineSpec("a", "http://127.0.0.1:1", "a")]


def test_the_keep_quantile_gives_the_chooser_its_tail_and_zero_none() -> None:
    default = Router(ENGINES, RouterSettings(), cache=None, tokenizer=None)
    assert default.chooser.tail is not None and default.chooser.tail.quantile == QUANTILE == 0.95
    assert Router(ENGINES, RouterSettings(keep_quantile=0.9), cache=None, tokenizer=None).chooser.tail.quantile == 0.9
    assert Router(ENGINES, RouterSettings(keep_quantile=0.0), cache=None, tokenizer=None).chooser.tail is None


@pytest.mark.parametrize("q", [-0.1, 1.0, 1.5])
def test_a_keep_quantile_outside_zero_to_one_is_refused(q: float) -> None:
    with pytest.raises(ConfigError, match=r"keep_quantile: must be in \[0, 1\)"):
        RouterSettings(keep_quantile=q)


def _gauge(router: Router) -> float:
    text = router.metrics.render().decode()
    line = next(x for x in text.splitlines() if x.startswith("kvtier_router_keep_tail_seconds "))
    return float(line.split()[1])


def test_the_keep_threshold_is_exported_once_there_is_one() -> None:
    router = Router(ENGINES, RouterSettings(), cache=None, tokenizer=None)
    tail = router.chooser.tail
    assert tail is not None
    for i in range(tail.min_samples - 1):
        tail.add(i / 1000)
    assert math.isnan(_gauge(router))  # control: one price short of a threshold, none is shown
    tail.add(0.5)
    assert _gauge(router) == tail.value() == pytest.approx(0.190)  # 95th of 0, 1, ..., 198 ms and 500 ms


def test_with_keeping_off_the_threshold_reads_nan() -> None:
    assert math.isnan(_gauge(Router(ENGINES, RouterSettings(keep_quantile=0.0), cache=None, tokenizer=None)))
