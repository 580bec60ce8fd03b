"""The engine suites run inside their own virtual environments (see test_engine_suites.py), never
in the main one: the main suite must not import vllm or sglang."""

collect_ignore = ["vllm_suite", "sglang_suite", "vllm_engine"]
