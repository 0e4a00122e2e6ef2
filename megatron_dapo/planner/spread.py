"""Spread items over ranks by bytes: which export source broadcasts which tensor (rollout.sync.sources).

Pure and deterministic, so that every trainer rank computes the same assignment from the same sizes
(the export's plan, `megatron_dapo.bridge.export`) and the refit estimate (`planner.refit`) uses the
same rule as the export it estimates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def spread_by_bytes(
    sizes: Mapping[str, int], candidates: Mapping[str, Sequence[int]], loads: Mapping[int, int]
) -> dict[str, int]:
    """{item: rank}: each item of `sizes` (bytes) goes to one of its `candidates` ranks, largest item first,
    to the candidate carrying the fewest bytes so far (ties: the lowest rank); `loads` are what ranks carry
    before. Greedy by bytes (longest processing time first): when items share their candidates, the
    busiest of them ends at most one item above their mean load. Items of equal size keep `sizes`' order."""
    load = {r: loads.get(r, 0) for c in candidates.values() for r in c}
    out = {}
    for item in sorted(sizes, key=lambda k: -sizes[k]):
        if not candidates[item]:
            raise ValueError(f"no candidate rank for {item!r}")
        rank = min(candidates[item], key=lambda r: (load[r], r))
        out[item] = rank
        load[rank] += sizes[item]
    return out
