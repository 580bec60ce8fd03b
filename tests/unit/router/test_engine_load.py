"""An engine's load from vLLM's /metrics text (kvtier/router/engine_load.py)."""

from __future__ import annotations

import pytest

from kvtier.router.engine_load import EngineLoad, parse_vllm_load

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
