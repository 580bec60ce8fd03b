"""Locate's two wire forms: the RPC's protobuf messages and the HTTP twin's JSON.

Both are translated to and from the same boundary objects (``LocateQuery``, ``Located``), so a
router gets the same answer whichever it uses. JSON input is checked field by field before
anything else happens; every mistake is an InvalidRequest that names the field.

JSON request (``POST /v1/locate``)::

    {"token_ids": [int, ...] | "keys": ["<112 hex digits>", ...],
     "cache_salt": "...", "model": "...", "tail_tokens": int,
     "omit_shared": bool, "local_only": bool}                        # all but one of the first two optional

JSON answer: ``located_json`` (docs/operations.md, "Locate").
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import InvalidRequest
from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.wire import check_keys
from kvtier.server.locate import UINT32_MAX, Located, LocateQuery, SharedShare, TierShare
from kvtier.store.lookup import TierRun

QUERY_FIELDS = frozenset({"token_ids", "keys", "cache_salt", "model", "tail_tokens", "omit_shared", "local_only"})
MAX_SALT_CHARS = 4096
MAX_MODEL_CHARS = 512


# -- protobuf ---------------------------------------------------------------------------------------
def query_from_msg(msg: pb.LocateRequest, max_keys: int) -> LocateQuery:
    return LocateQuery(tokens=tuple(msg.token_ids), keys=tuple(check_keys(msg.keys, max_keys)),
                       salt=_text("cache_salt", msg.cache_salt, MAX_SALT_CHARS),
                       model=_text("model", msg.model, MAX_MODEL_CHARS), tail_tokens=msg.tail_tokens,
                       omit_shared=msg.omit_shared, local_only=msg.local_only)


def query_to_msg(q: LocateQuery) -> pb.LocateRequest:
    return pb.LocateRequest(token_ids=list(q.tokens), keys=list(q.keys), cache_salt=q.salt, model=q.model,
                            tail_tokens=q.tail_tokens, omit_shared=q.omit_shared, local_only=q.local_only)


def located_to_msg(a: Located) -> pb.LocateResponse:
    out = pb.LocateResponse(
        node=a.node, model=a.model, block_tokens=a.block_tokens, requested_blocks=a.requested_blocks,
        new_tokens=a.new_tokens, matched_blocks=a.matched_blocks,
        tiers=[pb.TierBlocks(tier=t.tier, level=t.level, blocks=t.blocks) for t in a.tiers],
        runs=[pb.TierRun(tier=r.tier, level=r.level, start=r.start, count=r.count) for r in a.runs],
        ttft_ms=a.ttft_ms, plan=a.plan, recompute_ms=a.recompute_ms, tail_ms=a.tail_ms,
        public_blocks=a.public_blocks,
    )
    if a.shared is not None:
        out.shared.CopyFrom(pb.SharedTier(tier=a.shared.tier, blocks=a.shared.blocks, ttft_ms=a.shared.ttft_ms))
    return out


def located_from_msg(m: pb.LocateResponse) -> Located:
    shared = SharedShare(m.shared.tier, m.shared.blocks, m.shared.ttft_ms) if m.HasField("shared") else None
    return Located(
        node=m.node, model=m.model, block_tokens=m.block_tokens, requested_blocks=m.requested_blocks,
        new_tokens=m.new_tokens, matched_blocks=m.matched_blocks,
        tiers=tuple(TierShare(t.tier, t.level, t.blocks) for t in m.tiers),
        runs=tuple(TierRun(r.level, r.tier, r.start, r.count) for r in m.runs),
        ttft_ms=m.ttft_ms, plan=m.plan, recompute_ms=m.recompute_ms, tail_ms=m.tail_ms, shared=shared,
        public_blocks=m.public_blocks,
    )


# -- JSON -------------------------------------------------------------------------------------------
def located_json(a: Located) -> dict[str, Any]:
    return {
        "node": a.node, "model": a.model, "block_tokens": a.block_tokens, "requested_blocks": a.requested_blocks,
        "new_tokens": a.new_tokens, "matched_blocks": a.matched_blocks,
        "tiers": [{"tier": t.tier, "level": t.level, "blocks": t.blocks} for t in a.tiers],
        "runs": [{"tier": r.tier, "level": r.level, "start": r.start, "count": r.count} for r in a.runs],
        "ttft_ms": a.ttft_ms, "plan": a.plan, "recompute_ms": a.recompute_ms, "tail_ms": a.tail_ms,
        "public_blocks": a.public_blocks,
        "shared": None if a.shared is None else {"tier": a.shared.tier, "blocks": a.shared.blocks,
                                                 "ttft_ms": a.shared.ttft_ms},
    }


def query_from_json(body: Any, max_keys: int) -> LocateQuery:
    """A LocateQuery from a decoded JSON body; InvalidRequest naming the field for any mistake."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - QUERY_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s) {unknown}; known: {sorted(QUERY_FIELDS)}")
    tokens = body.get("token_ids", [])
    if not isinstance(tokens, list):
        raise InvalidRequest("token_ids: must be a list of integers")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= UINT32_MAX:
            raise InvalidRequest(f"token_ids[{i}]: must be an integer in [0, {UINT32_MAX}], got {t!r}")
    raw_keys = body.get("keys", [])
    if not isinstance(raw_keys, list):
        raise InvalidRequest("keys: must be a list of hex strings")
    keys: list[BlockKey] = []
    for i, k in enumerate(raw_keys):
        try:
            b = bytes.fromhex(k) if isinstance(k, str) else None
        except ValueError:
            b = None
        if b is None or len(b) != KEY_BYTES:
            raise InvalidRequest(f"keys[{i}]: must be {2 * KEY_BYTES} hex digits")
        keys.append(BlockKey(b))
    if len(keys) > max_keys:
        raise InvalidRequest(f"keys: at most {max_keys} per request, got {len(keys)}")
    salt = body.get("cache_salt", "")
    model = body.get("model", "")
    tail = body.get("tail_tokens", 0)
    if salt is None:
        salt = ""
    if isinstance(tail, bool) or not isinstance(tail, int):
        raise InvalidRequest(f"tail_tokens: must be an integer, got {tail!r}")
    flags = {}
    for name in ("omit_shared", "local_only"):  # the RPC's fields, for a router
        flag = body.get(name, False)
        if not isinstance(flag, bool):
            raise InvalidRequest(f"{name}: must be true or false, got {flag!r}")
        flags[name] = flag
    return LocateQuery(tokens=tuple(tokens), keys=tuple(keys), salt=_text("cache_salt", salt, MAX_SALT_CHARS),
                       model=_text("model", model, MAX_MODEL_CHARS), tail_tokens=tail, **flags)


def _text(name: str, v: Any, limit: int) -> str:
    if not isinstance(v, str):
        raise InvalidRequest(f"{name}: must be a string, got {type(v).__name__}")
    if len(v) > limit:
        raise InvalidRequest(f"{name}: at most {limit} characters, got {len(v)}")
    return v
