"""`kvtier route`: an OpenAI-compatible front for N engines that sends each request where its
first token comes soonest (issue 30 part 3; docs/operations.md, "Run a fleet").

Parts, one concept a file: ``engines`` (which engines, on which node), ``engine_load`` (an
engine's load from its own metrics), ``queue_model`` (the predicted queue wait), ``choice`` (the
lowest predicted time to first token, load balancing on ties), ``prompts`` (a request's token ids
as the engine will see them), ``engine_watch`` (health and load polling), ``cache_view`` (Locate
over the nodes that are up), ``proxy`` (one attempt, committed at its first byte), ``metrics``,
``errors`` (the error bodies) and ``app`` (the HTTP front that puts them together).
"""
