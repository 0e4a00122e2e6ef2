"""Staleness by reservation vs. by discarding, in simulated time (no servers, no trainer).

The producer of megatron_dapo.coordinator.producer before and after `StalenessController`, driven
by a discrete-event clock: groups take long-tailed generation times (lognormal) on `capacity`
concurrent group slots of the servers (a queue when all are busy; 0 = unlimited), optionally cut
at `max_time` (max_response_length truncates a real response, so its tail is bounded), a fraction is
dropped by dynamic sampling, the trainer takes a full batch, trains for a fixed time, and then the
servers hold the next version (all at once). Two policies in the same run:

- `discard` (the baseline, the producer as it was): at most (v + s + 1) * B groups produced at
  version v; completed groups queue FIFO; at take time a group dispatched more than s versions
  ago is thrown away (`groups/dropped_stale`) and its generation time is wasted;
- `reserve`: `megatron_dapo.coordinator.StalenessController` with the same s;
- `remedy` (only with `--extra-prompts E` and/or `--retry T`): `reserve` plus prompt-level redundancy
  (B + E reservations per buffer, the surplus aborted when a buffer fills) and/or the proactive
  filter (megatron_dapo.coordinator.retry, threshold T, applied while the trainer waits); an aborted
  group frees its server slot at once, and the generation time it had spent is counted as wasted;
- `psrl` (only with `--psrl-src DIR`, a checkout of github.com/Somoku/psrl): PSRL's own
  `StalenessInventory` (psrl/workers/ps/staleness_controller.py, imported unmodified; only its logger
  and a type alias are stubbed), called as PSRL's manager calls it, as the reference for `reserve`.

Printed per staleness s: trained groups per simulated second (x discard), groups discarded for
staleness, the share of generation time spent on discarded groups, mean staleness of trained
groups, and the trainer's idle share.

    python benchmarks/staleness_reservation.py [--steps 300 --batch 32 --train-s 2 --capacity 0 --max-time 0 --seeds 3]
        [--extra-prompts E] [--retry T]
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import logging
import random
import sys
import types
from collections import deque
from dataclasses import dataclass

from megatron_dapo.coordinator import StalenessController
from megatron_dapo.coordinator.retry import ProactiveRetry


class PsrlSlots:
    """PSRL's StalenessInventory behind StalenessController's interface, called the way PSRL's
    ps_manager / agent-loop manager call it (reserve_data, occupy_data_with_reserve, a dynamic-sampling
    drop as clear_reserved_entries without moving across buffers, consume = delete the READY buffer)."""

    def __init__(self, src: str, slots: int, staleness: int):
        psrl = _load_psrl(src)
        self.psrl, self.staleness = psrl, staleness
        self.inv = psrl.StalenessInventory(num_entries=slots, ready_num_entries=slots, staleness=staleness, rollout_n=1)
        self.next_buffer, self.items = 0, {}

    def _info(self, key, v_traj):
        return self.psrl.EntryInfo(rollout_instance_id=("sim", 0), prompt_id=key, request_idx=0, model_version=v_traj)

    def reservable(self, v_traj: int) -> int:
        return int(self.inv.get_empty_entries_total_num(v_traj + self.staleness))

    def reserve(self, key, v_traj: int):
        b, i = self.inv.reserve_data(self._info(key, v_traj), v_traj + self.staleness)
        assert b is not None, "PSRL refused a reservation it counted as available"
        return b, i

    def release(self, key) -> None:
        self.inv.clear_reserved_entries(key, False)

    def occupy(self, key, item):
        b, i, _ = self.inv.occupy_data_with_reserve(key)
        self.items[key] = item
        return b, i

    def ready(self) -> bool:
        b = self.next_buffer
        return b in self.inv.buffers and self.inv.get_buffer_status(b) == self.psrl.BufferStatus.READY

    def consume(self) -> list:
        keys = [e.entry_info.prompt_id for e in self.inv.buffers[self.next_buffer].entries]
        self.inv.delete_buffer(self.next_buffer)
        self.next_buffer += 1
        return [self.items.pop(k) for k in keys]


def _load_psrl(src: str):
    """Import PSRL's staleness_controller.py from a checkout without installing PSRL (its package
    __init__ pulls in Ray, vLLM and more): stub the two names it imports."""
    if "psrl_staleness_controller" in sys.modules:
        return sys.modules["psrl_staleness_controller"]
    logger = types.ModuleType("psrl.utils.logger")
    logger.get_ps_logger = lambda: logging.getLogger("psrl")
    gen = types.ModuleType("psrl.workers.gen.utils")
    gen.RolloutInstanceId = tuple
    for name, mod in {
        "psrl": None,
        "psrl.utils": None,
        "psrl.workers": None,
        "psrl.workers.gen": None,
        "psrl.utils.logger": logger,
        "psrl.workers.gen.utils": gen,
    }.items():
        sys.modules.setdefault(name, mod or types.ModuleType(name))
    path = f"{src}/psrl/workers/ps/staleness_controller.py"
    spec = importlib.util.spec_from_file_location("psrl_staleness_controller", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Result:
    time: float
    trained: int
    discarded: int
    gen_time: float
    wasted_time: float
    staleness_sum: int
    trainer_busy: float
    trained_at: dict  # group (draw) -> the step that trained it


def simulate(
    policy: str,
    staleness: int,
    batch: int,
    steps: int,
    train_s: float,
    p_drop: float,
    sigma: float,
    seed: int,
    capacity: int = 0,
    max_time: float = 0.0,
    psrl_src: str = "",
    extra_prompts: int = 0,
    retry: int = 0,
) -> Result:
    rng = random.Random(seed)
    now, version, draw = 0.0, 0, 0
    events: list = []  # (time, kind, payload)
    remedy = policy == "remedy"
    slots = (
        PsrlSlots(psrl_src, batch, staleness)
        if policy == "psrl"
        else StalenessController(batch, staleness, clock=lambda: now, extra=extra_prompts if remedy else 0)
    )
    retry_policy = ProactiveRetry(retry, clock=lambda: now) if remedy and retry else None
    started: dict[int, float] = {}  # remedy: draw -> when its generation started
    aborted: set[int] = set()  # remedy: groups given up (their completion events are ignored)
    reserving = policy != "discard"
    fifo: deque = deque()  # discard: completed groups (draw, V_traj, gen time)
    queue: deque = deque()  # dispatched groups waiting for a free server slot
    running = in_flight = consumed = 0
    trained = discarded = stale_sum = 0
    trained_at: dict[int, int] = {}
    gen_time = wasted = busy = 0.0
    training = False

    def start():
        nonlocal running
        while queue and (capacity == 0 or running < capacity):
            d, v, duration, dropped = queue.popleft()
            running += 1
            started[d] = now
            heapq.heappush(events, (now + duration, 1, (d, v, duration, dropped)))

    def abort(keys):
        """Give up groups: a queued one leaves the queue, a running one frees its server slot now."""
        nonlocal running, in_flight, gen_time, wasted
        for k in keys:
            aborted.add(k)
            in_flight -= 1
            if k in started:
                running -= 1
                gen_time += now - started[k]
                wasted += now - started[k]
            else:
                queue.remove(next(q for q in queue if q[0] == k))

    def dispatch():
        nonlocal draw, in_flight
        if reserving:
            n = slots.reservable(version)
        else:
            n = (version + staleness + 1) * batch - consumed - len(fifo) - in_flight
        for _ in range(max(0, n)):
            duration = rng.lognormvariate(0.0, sigma)
            if max_time > 0:
                duration = min(duration, max_time)
            if reserving:
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
        if reserving:
            if retry_policy is not None:
                out = retry_policy.apply(slots, trainer_waiting=True)
                if out is not None:
                    abort(out.aborted + slots.take_dropped())
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
        trained_at.update((d, step) for d, _, _ in taken)
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
            if d in aborted:
                aborted.discard(d)
                started.pop(d, None)
                try_take()
                dispatch()
                continue
            started.pop(d, None)
            in_flight -= 1
            running -= 1
            gen_time += duration
            if dropped:
                if reserving:
                    slots.release(d)
            elif reserving:
                slots.occupy(d, (d, v, duration))
                if remedy:
                    abort(slots.take_dropped())
            else:
                fifo.append((d, v, duration))
        try_take()
        dispatch()
    return Result(
        now + train_s, trained, discarded, gen_time, wasted, stale_sum, busy, trained_at
    )  # ends after the last step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="groups per step (B)")
    ap.add_argument("--train-s", type=float, default=2.0, help="trainer step time, in median generation times")
    ap.add_argument("--p-drop", type=float, default=0.3, help="share of groups dropped by dynamic sampling")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of generation times (the tail)")
    ap.add_argument("--capacity", type=int, default=0, help="concurrent groups the servers run (0 = unlimited)")
    ap.add_argument(
        "--max-time",
        type=float,
        default=0.0,
        help="cap on a group's generation time, in median times (max_response_length; 0 = none)",
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--psrl-src", default="", help="a PSRL checkout: adds PSRL's own controller as policy `psrl`")
    ap.add_argument("--extra-prompts", type=int, default=0, help="policy `remedy`: redundant reservations per buffer")
    ap.add_argument("--retry", type=int, default=0, help="policy `remedy`: proactive filter threshold (0 = off)")
    args = ap.parse_args()
    print(
        f"B={args.batch} steps={args.steps} train={args.train_s} p_drop={args.p_drop} sigma={args.sigma} "
        f"capacity={args.capacity} max_time={args.max_time} seeds={args.seeds} "
        f"extra_prompts={args.extra_prompts} retry={args.retry}"
    )
    remedy = ("remedy",) if args.extra_prompts or args.retry else ()
    print("| s | policy | groups/s | x discard | discarded | wasted gen % | mean staleness | trainer busy % |")
    print("|---|---|---|---|---|---|---|---|")
    for s in (0, 1, 2, 3):
        rows, trained_at = {}, {}
        for policy in ("discard", "reserve") + remedy + (("psrl",) if args.psrl_src else ()):
            rs = [
                simulate(
                    policy,
                    s,
                    args.batch,
                    args.steps,
                    args.train_s,
                    args.p_drop,
                    args.sigma,
                    seed,
                    args.capacity,
                    args.max_time,
                    args.psrl_src,
                    args.extra_prompts,
                    args.retry,
                )
                for seed in range(args.seeds)
            ]
            trained_at[policy] = [r.trained_at for r in rs]
            rows[policy] = (
                sum(r.trained / r.time for r in rs) / len(rs),
                sum(r.discarded for r in rs) / len(rs),
                100 * sum(r.wasted_time / r.gen_time for r in rs) / len(rs),
                sum(r.staleness_sum / r.trained for r in rs) / len(rs),
                100 * sum(r.trainer_busy / r.time for r in rs) / len(rs),
            )
        for policy, (gps, disc, waste, stale, busy) in rows.items():
            print(
                f"| {s} | {policy} | {gps:.2f} | {gps / rows['discard'][0]:.2f} | {disc:.1f} | {waste:.1f} "
                f"| {stale:.2f} | {busy:.1f} |"
            )
        if "psrl" in trained_at:
            pairs = [(a, b) for a, b in zip(trained_at["psrl"], trained_at["reserve"], strict=True)]
            same = sum(sum(a.get(d) == step for d, step in b.items()) for a, b in pairs)
            total = sum(len(b) for _, b in pairs)
            print(f"s={s}: groups PSRL's controller trains at the same step as ours: {same}/{total}", file=sys.stderr)


if __name__ == "__main__":
    main()
