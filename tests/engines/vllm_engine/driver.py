"""Runs one vLLM engine over a list of requests and prints what happened, one JSON line each.

Used by test_vllm_engine.py, each engine in a process of its own (vLLM's default executor then
starts its EngineCore and Worker processes under it). Input: a JSON file naming the model
checkpoint (``kvtier.engine.checkpoint``, loaded with vLLM's default loader) and its dtype, the
engine options and the requests (token ids, salt); output on stdout: ``{"request": i,
"token_ids": [...], "logprobs": [{token id: logprob}, ...], "num_cached_tokens": n}`` per request
(greedy, ``max_tokens`` tokens whatever the end-of-sequence token, the top ``logprobs`` candidates
of each), then ``{"done": true}``. Failed loads are recomputed (``kv_load_failure_policy``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.vllm_bench import wait_for_saves


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              enforce_eager=True, max_model_len=spec.get("max_model_len", 4096), block_size=spec.get("block_size", 32),
              enable_prefix_caching=spec.get("prefix_caching", False), seed=0, gpu_memory_utilization=0.3,
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096))
    if spec.get("kvtier") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="connectors.vllm_connector",
            kv_role="kv_both", kv_connector_extra_config=spec["kvtier"], kv_load_failure_policy="recompute")
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True,
                            logprobs=spec["logprobs"])
    for i, req in enumerate(spec["requests"]):
        prompt = {"prompt_token_ids": req["tokens"]}
        if req.get("salt") is not None:
            prompt["cache_salt"] = req["salt"]
        if req.get("before"):  # a hook for the test: e.g. wait until a file exists (daemon killed)
            import os
            import time
            while not os.path.exists(req["before"]):
                time.sleep(0.05)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        gen = out.outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in pos.items()} for pos in (gen.logprobs or [])]
        print("KVTIER_RESULT " + json.dumps({"request": i, "token_ids": list(gen.token_ids), "logprobs": logprobs,
                                             "num_cached_tokens": out.num_cached_tokens}), flush=True)
        stats_file = (spec.get("kvtier") or {}).get("kvtier.stats_file")
        if stats_file:  # the worker stores off the step: let the next lookup see this request's blocks
            wait_for_saves(Path(stats_file), 30.0)
        if req.get("after"):
            with open(req["after"], "w"):
                pass
    print("KVTIER_RESULT " + json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
