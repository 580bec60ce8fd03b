"""An engine's load as it reports it: vLLM's ``/metrics`` gauges of running and waiting requests.

``vllm:num_requests_running`` (scheduled: being prefilled or decoding) and
``vllm:num_requests_waiting`` (queued, not yet scheduled), summed over their label sets (one per
engine core of a data-parallel server). An engine without them (another server) reports
``known=False``; the router then relies on its own in-flight counts alone.

The router polls every engine each second on its one event loop, so the parse must be cheap: a
vLLM server's exposition is about 600 lines (50 KB of histograms), which prometheus_client's
parser, pure Python, takes 6-8 ms to read on an idle core (the loop stalls that long per engine
and poll). Two regular-expression passes (C) check that every line has the usual shape and keep
only the three families read here, which the parser then reads; text with any other line is
parsed whole, as it always was (valid or not, the parser decides).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
#: An info gauge whose ``num_gpu_blocks`` label is the size of the engine's own KV cache, and
#: whose ``enable_prefix_caching`` label says whether it keeps anything between requests.
CACHE_INFO = "vllm:cache_config_info"

#: A line that is none of: empty, a comment, a sample (``name[{labels}] number ...``).
_NOT_EXPOSITION = re.compile(r"^(?![ \t]*$|#|[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^\n]*\})?[ \t]+"
                             r"[-+]?(?:[0-9]|\.[0-9]|Inf|inf|NaN|nan))", re.MULTILINE)
_NAMES = "|".join(re.escape(n) for n in (RUNNING, WAITING, CACHE_INFO))
#: The samples of the three families read here, and their HELP and TYPE lines.
_WANTED = re.compile(r"^(?:# (?:HELP|TYPE) )?(?:" + _NAMES + r")(?![a-zA-Z0-9_:])[^\n]*$", re.MULTILINE)


@dataclass(slots=True, frozen=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    #: Whether the engine's metrics had the gauges (False: both counts are 0 for lack of news).
    known: bool = False
    #: Blocks the engine's own prefix cache holds (None: not reported; 0: prefix caching is off).
    cache_blocks: int | None = None


def parse_vllm_load(text: str) -> EngineLoad:
    """The load in a Prometheus text exposition; ValueError if the text does not parse."""
    # A line of a shape the fast check does not know (leading blanks, a blank before "{", quoted
    # names) is the full parser's to judge, as before: it raises on text it cannot read.
    wanted = text if _NOT_EXPOSITION.search(text) else "\n".join(_WANTED.findall(text)) + "\n"
    found: dict[str, float] = {}
    blocks: int | None = None
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if sample.name in (RUNNING, WAITING):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
            elif sample.name == CACHE_INFO:
                if sample.labels.get("enable_prefix_caching") == "False":
                    n = 0  # its blocks are freed as each request ends: it holds nothing for the next
                elif sample.labels.get("num_gpu_blocks", "").isdigit():
                    n = int(sample.labels["num_gpu_blocks"])
                else:
                    continue
                # One sample per engine core of a data-parallel server: the smallest holds for all.
                blocks = n if blocks is None else min(blocks, n)
    if not found:
        return EngineLoad(cache_blocks=blocks)
    return EngineLoad(running=round(found.get(RUNNING, 0.0)), waiting=round(found.get(WAITING, 0.0)), known=True,
                      cache_blocks=blocks)
