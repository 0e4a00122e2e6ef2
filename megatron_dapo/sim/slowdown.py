"""Transient engine slowdowns: a GPU throttling, a noisy neighbour, a straggling node.

A slowdown multiplies one engine's speed by `factor` (< 1: slower) from `start` for `duration` seconds
of simulated time, again every `every` seconds if given. Scripted ones come from
`--slowdown ENGINE:FACTOR:START:DURATION[:EVERY]`; random ones (`--random-slowdowns EVERY:FACTOR:DURATION`)
hit each engine at exponentially distributed gaps of mean EVERY seconds, drawn from the run's seed.
Slowdowns that overlap on one engine multiply.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass


def _numbers(flag: str, text: str, names: tuple[str, ...], optional: int = 0) -> list[float]:
    parts = text.split(":")
    if not len(names) - optional <= len(parts) <= len(names):
        raise ValueError(f"{flag} {text!r}: expected {':'.join(names)}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected numbers {':'.join(names)}") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{flag} {text!r}: numbers must be finite")
    return values


def _check_factor(flag: str, text: str, factor: float) -> None:
    if not 0 < factor <= 1:
        raise ValueError(f"{flag} {text!r}: FACTOR must be in (0, 1] (a share of the engine's speed)")


@dataclass(frozen=True)
class Slowdown:
    engine: int
    factor: float
    start: float
    duration: float
    every: float | None = None

    @classmethod
    def parse(cls, text: str, engines: int) -> "Slowdown":
        flag = "--slowdown"
        names = ("ENGINE", "FACTOR", "START", "DURATION", "EVERY")
        engine, factor, start, duration, *every = _numbers(flag, text, names, optional=1)
        if engine != int(engine) or not 0 <= engine < engines:
            raise ValueError(f"{flag} {text!r}: ENGINE must be an engine index in [0, {engines})")
        _check_factor(flag, text, factor)
        if start < 0 or duration <= 0:
            raise ValueError(f"{flag} {text!r}: START must be >= 0 and DURATION > 0 (seconds)")
        if every and every[0] < duration:
            raise ValueError(f"{flag} {text!r}: EVERY must be >= DURATION (one slowdown at a time per script)")
        return cls(int(engine), factor, start, duration, every[0] if every else None)


@dataclass(frozen=True)
class RandomSlowdowns:
    every: float  # mean seconds between slowdowns of one engine
    factor: float
    duration: float

    @classmethod
    def parse(cls, text: str) -> "RandomSlowdowns":
        flag = "--random-slowdowns"
        every, factor, duration = _numbers(flag, text, ("EVERY", "FACTOR", "DURATION"))
        _check_factor(flag, text, factor)
        if every <= 0 or duration <= 0:
            raise ValueError(f"{flag} {text!r}: EVERY and DURATION must be > 0 (seconds)")
        return cls(every, factor, duration)


class SlowdownDriver:
    """Applies slowdowns to engines on the simulation's loop: engine i runs at base_speed[i] times the
    product of the factors of its slowdowns in effect."""

    def __init__(self, engines: list, scripted=(), random_slowdowns: RandomSlowdowns | None = None, seed: int = 0):
        self.engines = engines
        self.base = [e.speed for e in engines]
        self.active: list[list[float]] = [[] for _ in engines]
        self.loop = asyncio.get_running_loop()
        self.started = 0  # slowdowns begun so far
        for s in scripted:
            self.loop.call_at(self.loop.time() + s.start, self._begin, s.engine, s.factor, s.duration, s.every)
        self.random = random_slowdowns
        if random_slowdowns is not None:
            self.rngs = [random.Random(f"slowdown/{seed}/{i}") for i in range(len(engines))]
            for i in range(len(engines)):
                self._draw_next(i)

    def _draw_next(self, i: int) -> None:
        r = self.random
        gap = self.rngs[i].expovariate(1.0 / r.every)
        self.loop.call_at(self.loop.time() + gap, self._begin_random, i)

    def _begin_random(self, i: int) -> None:
        self._begin(i, self.random.factor, self.random.duration, None)
        self._draw_next(i)

    def _begin(self, i: int, factor: float, duration: float, every: float | None) -> None:
        self.started += 1
        self.active[i].append(factor)
        self._apply(i)
        self.loop.call_at(self.loop.time() + duration, self._end, i, factor)
        if every is not None:
            self.loop.call_at(self.loop.time() + every, self._begin, i, factor, duration, every)

    def _end(self, i: int, factor: float) -> None:
        self.active[i].remove(factor)
        self._apply(i)

    def _apply(self, i: int) -> None:
        self.engines[i].set_speed(self.base[i] * math.prod(self.active[i]))
