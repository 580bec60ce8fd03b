"""Runs one vLLM engine over a list of requests and prints what happened, one JSON line each.

Used by test_vllm_engine.py, each engine in a process of its own (vLLM's default executor then
starts its EngineCore and Worker processes under it). Input: a JSON file naming the model
checkpoint (``kvtier.engine.checkpoint``, loaded with vLLM's default loader) and its dtype, the
engine options, the requests (token ids, salt) and, with kvtier, ``flush_salt``: a salt the
engine has already resolved (one of its requests'). Output on stdout: ``{"request": i,
"token_ids": [...], "logprobs": [{token id: logprob}, ...], "num_cached_tokens": n}`` per request
(greedy, ``max_tokens`` tokens whatever the end-of-sequence token, the top ``logprobs`` candidates
of each), then ``{"done": true}``. Failed loads are recomputed (``kv_load_failure_policy``).
``kv_events``: an endpoint on which vLLM publishes its KV events (``--kv-events-config``).

With kvtier, each line also carries ``counters``: the connector's counters as vLLM's own metrics
hold them (``vllm:kvtier_connector_events_total``, ``LLM.get_metrics()``), ``{role: {event: n}}``,
once the worker has stored every block it was handed (its saves run off the step, and the next
request must see them). A count the worker makes between steps reaches the metrics with the next
step, so the driver runs flush requests: ``flush_salt``'s 8 tokens, one output token, no full
block, so the connector counts nothing for them (a request without a salt would count
``no_salt``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

FLUSH_TOKENS = [3] * 8
Counters = dict[str, dict[str, int]]


def kvtier_counters(llm: Any) -> Counters:
    """The kvtier connector's counters in the engine's metrics, ``{role: {event: n}}`` (summed
    over engines)."""
    from connectors.vllm_stats import EVENTS_METRIC

    out: Counters = {}
    for m in llm.get_metrics():
        if m.name == EVENTS_METRIC:
            per_role = out.setdefault(m.labels["role"], {})
            per_role[m.labels["event"]] = per_role.get(m.labels["event"], 0) + int(m.value)
    return out


def flush(llm: Any, salt: str) -> None:
    """One engine step that involves kvtier in nothing: it carries the counts made since the last
    step into vLLM's metrics."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    llm.generate([{"prompt_token_ids": FLUSH_TOKENS, "cache_salt": salt}], params, use_tqdm=False)


def wait_for_saves(llm: Any, salt: str, timeout_s: float = 60.0) -> Counters:
    """Flush until the worker has stored every save job it was handed (its ``save_jobs_stored``
    caught up with its ``save_jobs_submitted``); the counters then."""
    from kvtier.errors import DeadlineExceeded

    deadline = time.monotonic() + timeout_s
    while True:
        flush(llm, salt)
        counters = kvtier_counters(llm)
        worker = counters.get("worker", {})
        submitted, stored = worker.get("save_jobs_submitted", 0), worker.get("save_jobs_stored", 0)
        if stored >= submitted:
            return counters
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"the worker stored {stored} of the {submitted} save jobs it was handed "
                                   f"in {timeout_s:.0f} s")
        time.sleep(0.05)


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from connectors.vllm_stats import TIER_ERRORS_EVERY_S

    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              enforce_eager=True, max_model_len=spec.get("max_model_len", 4096), block_size=spec.get("block_size", 32),
              enable_prefix_caching=spec.get("prefix_caching", False), seed=0, gpu_memory_utilization=0.3,
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
              # The connector's counters reach vLLM's metrics only with stats on.
              disable_log_stats=False)
    kvtier = spec.get("kvtier") is not None
    if kvtier:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="connectors.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config=spec["kvtier"], kv_load_failure_policy="recompute")
    if spec.get("kv_events"):  # vLLM's own KV-event publisher, on this endpoint (kvtier adds its tiers)
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=spec["kv_events"])
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True,
                            logprobs=spec["logprobs"])
    for i, req in enumerate(spec["requests"]):
        prompt = {"prompt_token_ids": req["tokens"]}
        if req.get("salt") is not None:
            prompt["cache_salt"] = req["salt"]
        if req.get("before"):  # a hook for the test: e.g. wait until a file exists (daemon killed)
            import os
            while not os.path.exists(req["before"]):
                time.sleep(0.05)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        gen = out.outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in pos.items()} for pos in (gen.logprobs or [])]
        result: dict[str, Any] = {"request": i, "token_ids": list(gen.token_ids), "logprobs": logprobs,
                                  "num_cached_tokens": out.num_cached_tokens}
        if kvtier:  # the worker stores off the step: let the next lookup see this request's blocks
            result["counters"] = wait_for_saves(llm, spec["flush_salt"])
        print("KVTIER_RESULT " + json.dumps(result), flush=True)
        if req.get("after"):
            with open(req["after"], "w"):
                pass
    done: dict[str, Any] = {"done": True}
    if kvtier:
        # The tiers' error counts are asked for at most every TIER_ERRORS_EVERY_S: one more step
        # after that long carries the last of them.
        wait_for_saves(llm, spec["flush_salt"])
        time.sleep(TIER_ERRORS_EVERY_S + 0.05)
        flush(llm, spec["flush_salt"])
        done["counters"] = kvtier_counters(llm)
    print("KVTIER_RESULT " + json.dumps(done), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
