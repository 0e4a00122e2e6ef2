"""Staleness by reservation vs. by discarding, in simulated time (no servers, no trainer).

The producer of megatron_dapo.trainer.rollout_side before and after `StalenessController`, driven
by a discrete-event clock: groups take long-tailed generation times (lognormal) on `capacity`
concurrent group slots of the servers (a queue when all are busy; 0 = unlimited), a fraction is
dropped by dynamic sampling, the trainer takes a full batch, trains for a fixed time, and then the
servers hold the next version (all at once). Two policies in the same run:

- `discard` (the baseline, the producer as it was): at most (v + s + 1) * B groups produced at
  version v; completed groups queue FIFO; at take time a group dispatched more than s versions
  ago is thrown away (`groups/dropped_stale`) and its generation time is wasted;
- `reserve`: `megatron_dapo.coordinator.StalenessController` with the same s.

Printed per staleness s: trained groups per simulated second (x discard), groups discarded for
staleness, the share of generation time spent on discarded groups, mean staleness of trained
groups, and the trainer's idle share.

    python benchmarks/staleness_reservation.py [--steps 300 --batch 32 --train-s 2 --capacity 0 --seeds 3]
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import deque
from dataclasses import dataclass

from megatron_dapo.coordinator import StalenessController


@dataclass
class Result:
    time: float
    trained: int
    discarded: int
    gen_time: float
    wasted_time: float
    staleness_sum: int
    trainer_busy: float


def simulate(policy: str, staleness: int, batch: int, steps: int, train_s: float, p_drop: float, sigma: float,
             seed: int, capacity: int = 0) -> Result:
    rng = random.Random(seed)
    now, version, draw = 0.0, 0, 0
    events: list = []  # (time, kind, payload)
    slots = StalenessController(batch, staleness, clock=lambda: now)
    fifo: deque = deque()  # discard: completed groups (draw, V_traj, gen time)
    queue: deque = deque()  # dispatched groups waiting for a free server slot
    running = in_flight = consumed = 0
    trained = discarded = stale_sum = 0
    gen_time = wasted = busy = 0.0
    training = False

    def start():
        nonlocal running
        while queue and (capacity == 0 or running < capacity):
            d, v, duration, dropped = queue.popleft()
            running += 1
            heapq.heappush(events, (now + duration, 1, (d, v, duration, dropped)))

    def dispatch():
        nonlocal draw, in_flight
        if policy == "reserve":
            n = slots.reservable(version)
        else:
            n = (version + staleness + 1) * batch - consumed - len(fifo) - in_flight
        for _ in range(max(0, n)):
            duration = rng.lognormvariate(0.0, sigma)
            if policy == "reserve":
                slots.reserve(draw, version)
            in_flight += 1
            queue.append((draw, version, duration, rng.random() < p_drop))
            draw += 1
        start()

    def try_take():
        nonlocal training, consumed, trained, discarded, stale_sum, wasted, busy
        if training:
            return
        step = consumed // batch
        if step >= steps or version != step:
            return
        if policy == "reserve":
            if not slots.ready():
                return
            taken = slots.consume()
        else:
            while fifo and step - fifo[0][1] > staleness:
                discarded += 1
                wasted += fifo.popleft()[2]
            if len(fifo) < batch:
                return
            taken = [fifo.popleft() for _ in range(batch)]
        consumed += batch
        trained += batch
        stale_sum += sum(step - v for _, v, _ in taken)
        training = True
        busy += train_s
        heapq.heappush(events, (now + train_s, 0, None))

    dispatch()
    while consumed < steps * batch:
        now, kind, payload = heapq.heappop(events)
        if kind == 0:  # a step trained: the servers now hold the next version
            training = False
            version += 1
        else:
            d, v, duration, dropped = payload
            in_flight -= 1
            running -= 1
            gen_time += duration
            if dropped:
                if policy == "reserve":
                    slots.release(d)
            elif policy == "reserve":
                slots.occupy(d, (d, v, duration))
            else:
                fifo.append((d, v, duration))
        try_take()
        dispatch()
    return Result(now + train_s, trained, discarded, gen_time, wasted, stale_sum, busy)  # ends after the last step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="groups per step (B)")
    ap.add_argument("--train-s", type=float, default=2.0, help="trainer step time, in median generation times")
    ap.add_argument("--p-drop", type=float, default=0.3, help="share of groups dropped by dynamic sampling")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of generation times (the tail)")
    ap.add_argument("--capacity", type=int, default=0, help="concurrent groups the servers run (0 = unlimited)")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print(f"B={args.batch} steps={args.steps} train={args.train_s} p_drop={args.p_drop} sigma={args.sigma} "
          f"capacity={args.capacity} seeds={args.seeds}")
    print("| s | policy | groups/s | x discard | discarded | wasted gen % | mean staleness | trainer busy % |")
    print("|---|---|---|---|---|---|---|---|")
    for s in (0, 1, 2, 3):
        rows = {}
        for policy in ("discard", "reserve"):
            rs = [simulate(policy, s, args.batch, args.steps, args.train_s, args.p_drop, args.sigma, seed,
                           args.capacity)
                  for seed in range(args.seeds)]
            rows[policy] = (sum(r.trained / r.time for r in rs) / len(rs), sum(r.discarded for r in rs) / len(rs),
                            100 * sum(r.wasted_time / r.gen_time for r in rs) / len(rs),
                            sum(r.staleness_sum / r.trained for r in rs) / len(rs),
                            100 * sum(r.trainer_busy / r.time for r in rs) / len(rs))
        for policy, (gps, disc, waste, stale, busy) in rows.items():
            print(f"| {s} | {policy} | {gps:.2f} | {gps / rows['discard'][0]:.2f} | {disc:.1f} | {waste:.1f} "
                  f"| {stale:.2f} | {busy:.1f} |")


if __name__ == "__main__":
    main()
