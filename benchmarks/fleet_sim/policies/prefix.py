"""The prefix walk every index-reading policy shares: per node, the media of its leading blocks."""

from __future__ import annotations

from benchmarks.fleet_sim.events import BlockIndex


def leading_masks(index: BlockIndex, keys: tuple[int, ...]) -> dict[int, list[int]]:
    """node -> the index's media mask of each of the request's leading blocks that node holds,
    from block 0 up to its first miss (nodes holding block 0 only)."""
    holders = index.holders
    if not keys:
        return {}
    first = holders.get(keys[0])
    if not first:
        return {}
    out = {node: [mask] for node, mask in first.items()}
    active = set(out)
    for key in keys[1:]:
        where = holders.get(key)
        if not where:
            break
        for node in list(active):
            mask = where.get(node)
            if mask:
                out[node].append(mask)
            else:
                active.discard(node)
        if not active:
            break
    return out
