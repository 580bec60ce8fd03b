"""What ``kvtier route`` spends of its event loop on one request's prompt, before it is sent.

The router runs on one event loop: while it digests a prompt, no other request moves. This times,
for prompts of 1,024, 16,384 and 131,072 token ids (``locate.max_tokens``) at vLLM's 16-token
blocks, each step the router takes on a request's token ids in its own process
(kvtier/router/app.py, ``_completion``): the body's JSON, the prompt check (kvtier/router/prompts.py),
the block digests (kvtier/router/engine_cache.py), the held rule's decision (for a new prompt, and
for one an engine holds) and its record of what was sent (kvtier/router/held_rule.py,
kvtier/router/seen_blocks.py), the prefix's demand (kvtier/router/prefix_demand.py), the
engine-cache view's bookkeeping and ``Locate``'s request (built and serialized once, then sent to
every node: kvtier/server/fleet_view.py; ``locate_request_serialize`` is what serializing it
again for each node would cost per node). Median of 7 runs each, 4 engines, a fresh router state per
prompt length; the network and ``Locate`` are not in it.

Run from the repository root: ``.venv/bin/python benchmarks/results/issue30/scripts/router_cpu.py``
(prints JSON; figures in docs/operations.md, "What a long prompt costs the router").
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvtier.router.choice import Chooser, Edge
from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engines import EngineSpec
from kvtier.router.held_rule import HeldRule
from kvtier.router.pace import Pace
from kvtier.router.prefix_demand import PrefixDemand
from kvtier.router.prompts import COMPLETIONS, request_prompt
from kvtier.router.queue_model import QueueModel
from kvtier.server.locate import LocateQuery
from kvtier.server.locate_wire import query_to_msg

BLOCK_TOKENS = 16
RUNS = 7


def median_ms(step: Callable[[], Any]) -> float:
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def measure(n_tokens: int, rng: random.Random) -> dict[str, float]:
    engines = [EngineSpec(n, f"http://{n}", n) for n in "abcd"]
    names = [e.name for e in engines]
    cached = EngineCacheView(names, default_blocks=1 << 20)
    demand = PrefixDemand()
    queue = QueueModel(names)
    rule = HeldRule(engines, cached, queue, Chooser(Edge()), Pace(names), demand)
    raw = json.dumps({"prompt": [rng.randrange(10, 128_000) for _ in range(n_tokens)], "cache_salt": "s"}).encode()
    body = json.loads(raw)
    prompt = request_prompt(COMPLETIONS, body, None)
    assert prompt.tokens is not None and len(prompt.tokens) == n_tokens
    digests = cached.digests(prompt.tokens, prompt.salt, BLOCK_TOKENS)
    query = LocateQuery(tokens=prompt.tokens, salt=prompt.salt, local_only=True)
    msg = query_to_msg(query)
    out = {
        "json_body": median_ms(lambda: json.loads(raw)),
        "prompt_check": median_ms(lambda: request_prompt(COMPLETIONS, body, None)),
        "digests": median_ms(lambda: cached.digests(prompt.tokens, prompt.salt, BLOCK_TOKENS)),
        "held_rule_decide": median_ms(lambda: rule.decide(engines, digests, 1.0)),
        "held_rule_sent": median_ms(lambda: rule.sent(engines[0], digests)),
        "demand": median_ms(lambda: (demand.arrived(digests, 1.0), demand.rate(digests, len(digests), 1.0))),
        "engine_cache_sent_computed": median_ms(lambda: cached.computed(cached.sent("a", digests))),
        "locate_request": median_ms(lambda: query_to_msg(query).SerializeToString()),
        "locate_request_serialize": median_ms(lambda: msg.SerializeToString()),
    }
    # A later turn: engine a holds the prompt (a prefill measured there), so the held rule prices
    # every engine (it then asks Locate all the same: no node's block price is known here).
    for e in names:
        queue.first_byte(queue.sent(e, 0.0, streaming=True, expected_first_s=0.05), 0.05)
    out["held_rule_decide_held"] = median_ms(lambda: rule.decide(engines, digests, 1.0))
    out["total"] = round(sum(v for k, v in out.items() if k != "locate_request_serialize"), 3)
    return out


def main() -> int:
    rng = random.Random(30)
    print(json.dumps({"block_tokens": BLOCK_TOKENS, "runs": RUNS,
                      "ms": {n: measure(n, rng) for n in (1024, 16384, 131072)}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
