"""torchrun worker of tests/sync/test_parts.py: `TurnTaking` over 3 gloo ranks, sources [0, 1, 2].

usage: turn_taking.py OUT_JSON ORDER_FILE
Each source appends its rank to ORDER_FILE when its turn comes (rank 2 is ready first, rank 0 last); then a
round where source 1 fails, one where every failed source lost servers, a regroup where source 1's fails,
and rank 0's decision. Rank 0 writes what every rank saw.
"""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from megatron_dapo.sync.errors import ServersLost, WeightSyncError
from megatron_dapo.sync.topology import TurnTaking
from megatron_dapo.sync.update_group import StreamCounts


def take_turn(topology: TurnTaking, order_file: str, error: BaseException | None) -> bool:
    ok = topology.wait_turn()
    with open(order_file, "a") as f:
        f.write(f"{topology.rank}\n")
    topology.pass_turn(ok and error is None)
    return ok


def main():
    out, order_file = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topology = TurnTaking([0, 1, 2], rank)
    formed = []
    topology.connect(lambda: formed.append(time.monotonic()))
    seen = {"formed": len(formed), "group_name": topology.group_name("g")}

    time.sleep(0.4 * (2 - rank))  # the later sources are ready first
    take_turn(topology, order_file, None)
    agreed = topology.agree(None, StreamCounts(rank, 10 * rank, 1))
    seen["source_bytes"] = topology.source_bytes(agreed)

    failing = WeightSyncError("bucket refused") if rank == 1 else None
    seen["turn_after_failure"] = take_turn(topology, order_file + ".2", failing)
    failed = topology.agree(failing, StreamCounts())
    seen["failure"] = [type(failed.failure).__name__, str(failed.failure), failed.lost is None]

    gone = ServersLost("lost", {f"http://s{rank}": f"gone at {rank}"}) if rank in (0, 2) else None
    lost = topology.agree(gone, StreamCounts())
    seen["lost"] = [type(lost.failure).__name__, lost.lost.reasons if lost.lost else None]

    def reform():
        if rank == 1:
            raise RuntimeError("cannot form")

    seen["regroup_errors"] = topology.regroup(reform, catch=True)
    seen["decision"] = topology.decide(lambda: (["http://back"], rank))

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
