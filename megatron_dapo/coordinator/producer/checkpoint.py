"""Checkpoints of the producer: data position, completed groups not yet trained, groups in flight."""

from __future__ import annotations

from megatron_dapo.coordinator.groups import JudgedGroup, sample_from_state, sample_to_state
from megatron_dapo.coordinator.producer.settings import InFlight, ProducerSettings
from megatron_dapo.coordinator.producer.state import ProducerState
from megatron_dapo.coordinator.staleness import RESERVED, StalenessController


def state_dict(p: ProducerState) -> dict:
    """On the loop (or in place when none runs), under the lock: see `RolloutProducer.state_dict`."""
    occupied = p.slots.occupied_items()
    return {
        "sampler": p.sampler.state_dict(),
        "consumed": p.consumed,
        "version": p.version,
        "buffer": [g.to_state() for _, _, g in occupied],
        "slots": [[b, i] for b, i, _ in occupied],
        "in_flight": [
            {
                "draw": d,
                "idx": f.idx,
                "v_traj": f.v_traj,
                "slot": list(p.slots.where[d]),
                "samples": None
                if f.samples is None
                else [None if s is None else sample_to_state(s) for s in f.samples],
            }
            for d, f in sorted(p.flight.items())
        ],
    }


def restored_slots(settings: ProducerSettings, clock, state: dict) -> tuple[StalenessController, dict[int, InFlight]]:
    """The staleness slots and the groups in flight a checkpoint `state` saved (built off the loop)."""
    B = settings.train_batch_size
    consumed = int(state["consumed"])
    if consumed % B:
        raise ValueError(f"rollout state: {consumed} groups consumed is not a multiple of train_batch_size {B}")
    groups = [JudgedGroup.from_state(g) for g in state["buffer"]]
    # checkpoints older than the staleness slots: completed groups fill the next buffers in order
    where = state.get("slots") or [(consumed // B + i // B, i % B) for i in range(len(groups))]
    slots = StalenessController(
        B, settings.staleness, clock=clock, next_buffer=consumed // B, extra=settings.extra_prompts
    )
    for n, (g, (b, i)) in enumerate(zip(groups, where)):
        v_traj = g.v_traj if g.v_traj >= 0 else g.min_version
        slots.restore(g.draw if g.draw >= 0 else f"restored-{n}", v_traj, int(b), int(i), g)
    flight = {}
    for f in state.get("in_flight") or []:
        draw = int(f["draw"])
        slots.restore(draw, int(f["v_traj"]), int(f["slot"][0]), int(f["slot"][1]), state=RESERVED)
        samples = None if f["samples"] is None else [None if s is None else sample_from_state(s) for s in f["samples"]]
        flight[draw] = InFlight(int(f["idx"]), int(f["v_traj"]), samples)
    return slots, flight


def install(p: ProducerState, state: dict, slots: StalenessController, flight: dict[int, InFlight]) -> None:
    """On the loop (or in place), under the lock: the restored state replaces the producer's."""
    p.sampler.load_state_dict(state["sampler"])
    p.version = int(state["version"])
    p.slots, p.flight = slots, flight
    p.redispatch = sorted(flight)
