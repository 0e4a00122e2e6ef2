"""One simulated training run: the project's coordinator against simulated engines and trainer.

Real: the rollout producer (dispatch, judge, dynamic sampling, partial rollout), its
StalenessController, the Router and its ServerRegistry, the sync policies and the per-server sync
loop's decisions, all built from the config by the coordinator's own `build_producer`.
Simulated: the engines (megatron_dapo.sim.engine), the HTTP client, prompts and rewards
(megatron_dapo.sim.client), the trainer (a step takes `train_s(tokens)`; a weight sync `sync_s`).
Everything runs on one virtual-time event loop (megatron_dapo.sim.vtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from megatron_dapo.config.cost_model import CostModel
from megatron_dapo.coordinator.load_poller import LoadPoller, poll_interval_s
from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.coordinator.sync_policy import make_sync_policy
from megatron_dapo.sim.client import SimClient, SimPrompts, SimReward
from megatron_dapo.sim.engine import KVAdmission, SimEngine
from megatron_dapo.sim.slowdown import RandomSlowdowns, Slowdown, SlowdownDriver
from megatron_dapo.sim.static_engine import SplitArrivalsEngine, StaticBatchEngine
from megatron_dapo.sim.vtime import run_virtual

ENGINES = {"continuous": SimEngine, "static": StaticBatchEngine, "static_split": SplitArrivalsEngine}


@dataclass
class World:
    """What the config does not say about the simulated cluster."""

    cost: CostModel
    kv_capacity: int  # tokens per engine
    max_running: int  # requests per engine
    train_s: Callable[[int], float]  # trained tokens -> seconds of one training step
    sync_s: float  # seconds of one weight sync (trainer busy for all_at_once; the server out for per-server)
    keep_prob: float  # dynamic sampling: probability a group has a reward spread
    lengths: object  # megatron_dapo.planner.lengths model
    prompt_len: int = 256
    token_unit: int = 1
    steps: int = 8
    warmup_steps: int = 2
    seed: int = 0
    prompts: int = 100_000
    admission: KVAdmission | None = KVAdmission()  # engines' KV budget for admitting (None: input only)
    # "continuous": SGLang's batching (SimEngine); "static" / "static_split": the embedded server's, a batch
    # runs to its end before waiting requests start (sim/static_engine.py: the two bounds for a burst of
    # requests reaching an idle server), to simulate CPU runs of the embedded servers
    batching: str = "continuous"
    # per-server sync (greedy / status_based): seconds of a sync of engine i, drawn anew per sync (e.g. from a
    # real run's measured ones of that server: servers that start together finish apart, and the first to
    # finish takes the work dispatched meanwhile); None: every sync takes `sync_s`
    server_sync_s: Callable[[int], float] | None = None  # engine index -> seconds
    # the cost model throughput_optimal routing believes (None: the engines' own, `cost`); to replay a real
    # run whose router loaded another fit than the one its engines were measured by
    router_cost: CostModel | None = None
    # uneven engines: engine i runs at engine_speed[i] times the cost model's pace and holds engine_kv[i]
    # KV tokens (None: all at 1.0 and `kv_capacity`)
    engine_speed: tuple[float, ...] | None = None
    engine_kv: tuple[int, ...] | None = None
    slowdowns: tuple[Slowdown, ...] = ()  # scripted transient slowdowns
    random_slowdowns: RandomSlowdowns | None = None  # seeded by `seed`

    def engine_kvs(self, engines: int) -> list[int]:
        return list(self.engine_kv) if self.engine_kv is not None else [self.kv_capacity] * engines

    def engine_speeds(self, engines: int) -> list[float]:
        return list(self.engine_speed) if self.engine_speed is not None else [1.0] * engines

    def check(self, engines: int, max_response_length: int) -> None:
        """ValueError naming the option whose per-engine list does not match the engine count, or a KV
        pool that cannot hold one whole request (it would be retracted for ever)."""
        for flag, values in (("--engine-speed", self.engine_speed), ("--engine-kv", self.engine_kv)):
            if values is not None and len(values) != engines:
                raise ValueError(f"{flag}: {len(values)} values for {engines} engines (rollout.num_servers)")
        request = self.prompt_len + max_response_length + 1
        if min(self.engine_kvs(engines)) < request:
            raise ValueError(
                f"--engine-kv / --gpu-mem-gib: a KV pool of {min(self.engine_kvs(engines))} tokens cannot hold one "
                f"request ({self.prompt_len} prompt + {max_response_length} response tokens)"
            )
        for s in self.slowdowns:
            if s.engine >= engines:
                raise ValueError(f"--slowdown: engine {s.engine} of {engines} engines (rollout.num_servers)")


@dataclass
class SimResult:
    steps: int
    wall_s: float  # simulated seconds of the measured steps
    tokens_per_s: float  # trained (prompt + response) tokens per second
    rollout_busy: float  # share of engine time spent decoding
    trainer_busy: float  # share of the wall time the trainer computes (not waiting, not syncing)
    mean_staleness: float
    max_staleness: int
    step_s: float  # mean time per step
    aborted_tokens: int  # generated by requests that were aborted (continued by partial rollout)
    regenerated_tokens: int  # thrown away (aborted groups regenerated from scratch)
    retractions: int
    migrations: int
    generated_per_s: float = 0.0  # tokens the engines decoded per second (kept, filtered or aborted)
    mean_decode_batch: float = 0.0  # requests per decode step, over all engines' steps
    refusals: int = 0  # times routing kept a request waiting (admission control)
    # Completed groups held for later steps (their tokens) at the window's end minus at its start. A run
    # that fills its staleness buffers during the window trains less than it produces, one that drains
    # them more: trained tokens/s is the steady-state rate only when this is small beside `tokens`.
    banked_change: int = 0
    produced_per_s: float = 0.0  # (trained tokens + banked_change) / wall: kept groups' tokens per second
    banked_draws: list = field(default_factory=list, repr=False)  # draws of the groups held at the end
    batches: list = field(default_factory=list, repr=False)  # BatchInfo per step (all steps)
    step_ends: list = field(default_factory=list, repr=False)  # virtual time each step ended

    def summary(self) -> dict:
        """The numbers, without the batches (plain data for JSON)."""
        skip = ("batches", "step_ends", "banked_draws")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def _urls(n: int) -> list[str]:
    return [f"http://sim-engine-{i}" for i in range(n)]


def simulate(cfg, world: World) -> SimResult:
    """Run `world.warmup_steps + world.steps` training steps of `cfg` in virtual time."""
    return run_virtual(_run(cfg, world))


async def _run(cfg, world: World) -> SimResult:
    from megatron_dapo.coordinator.build import build_producer

    cfg = copy.deepcopy(cfg)
    loop = asyncio.get_running_loop()
    urls = _urls(cfg.rollout.num_servers)
    engine_cls = ENGINES.get(world.batching)
    if engine_cls is None:
        raise ValueError(f"simulate: batching must be one of {sorted(ENGINES)}, got {world.batching!r}")
    world.check(len(urls), cfg.data.max_response_length)
    kvs, speeds = world.engine_kvs(len(urls)), world.engine_speeds(len(urls))
    engines = {
        u: engine_cls(
            world.cost, kvs[i], world.max_running, version=0, loop=loop, admission=world.admission, speed=speeds[i]
        )
        for i, u in enumerate(urls)
    }
    if world.slowdowns or world.random_slowdowns:
        SlowdownDriver(list(engines.values()), world.slowdowns, world.random_slowdowns, world.seed)
    max_units = math.ceil(cfg.data.max_response_length / world.token_unit)
    if (cfg.rollout.sampling.max_new_tokens or cfg.data.max_response_length) != cfg.data.max_response_length:
        raise ValueError("simulate: rollout.sampling.max_new_tokens must be unset or equal data.max_response_length")
    cfg.rollout.sampling.max_new_tokens = max_units  # the producer asks in ids of token_unit tokens each
    cfg.data.max_response_length = max_units
    ob = cfg.algo.overlong_buffer
    ob.len = max(1, min(max_units, ob.len // world.token_unit))

    def client(url, api_key=None, **_http):  # the router's and the load poller's clients
        return SimClient(url, engines[url], world.lengths, max_units, world.token_unit, world.seed)

    registry = ServerRegistry(urls, version=0, clock=loop.time)
    dataset = SimPrompts(world.prompts, world.prompt_len, world.token_unit)
    producer = build_producer(
        cfg,
        urls,
        dataset,
        None,
        registry,
        client_factory=client,
        clock=loop.time,
        cost_model=world.router_cost or world.cost,  # throughput_optimal's model
        rewards=SimReward(world.keep_prob, world.seed),
    )
    changed = asyncio.Event()
    producer.add_listener(lambda: loop.call_soon(changed.set))

    trainer = SimTrainer(cfg, world, producer, registry, engines, changed)
    producing = asyncio.create_task(producer.run(), name="producer")
    polling = poller = None
    if (interval := poll_interval_s(cfg.rollout)) is not None:  # each engine's load into the registry
        poller = LoadPoller(registry, interval, client_factory=client)
        polling = asyncio.create_task(poller.run(), name="load-poller")
    syncing = None
    if cfg.rollout.sync.policy != "all_at_once":
        syncing = asyncio.create_task(trainer.per_server_sync(), name="per-server-sync")
    try:
        await trainer.train(world.warmup_steps + world.steps)
    finally:
        if syncing is not None:
            trainer.stopping = True
            syncing.cancel()
            await asyncio.gather(syncing, return_exceptions=True)
            for t in list(trainer.sync_tasks):  # only now: the loop may start one more before it stops
                t.cancel()
            await asyncio.gather(*trainer.sync_tasks, return_exceptions=True)
        producer.stop()  # its loop leaves and cancels the groups in flight
        await producing
        if poller is not None:
            poller.stop()
            await polling
    return trainer.result(world.warmup_steps, engines.values())


class SimTrainer:
    """The training loop's timeline: take the batch, train, sync; the per-server sync loop."""

    def __init__(
        self,
        cfg,
        world: World,
        producer,
        registry: ServerRegistry,
        engines: dict[str, SimEngine],
        changed: asyncio.Event,
    ):
        self.cfg, self.world, self.producer, self.registry = cfg, world, producer, registry
        self.engines, self.changed = engines, changed
        self.loop = asyncio.get_running_loop()
        self.sync_cfg = cfg.rollout.sync
        self.stored = 0  # newest weight version (per-server sync: in the store)
        self.stored_event = asyncio.Event()
        self.stopping = False
        self.sync_tasks: set[asyncio.Task] = set()
        self.batches, self.step_ends, self.train_busy = [], [], []
        self.engine_busy: list[float] = []  # total engine busy time at each step end
        self.engine_work: list[tuple[int, int]] = []  # (tokens, decode steps) of all engines at each step end
        self.banked: list[int] = []  # tokens of completed groups held for later steps, at each step end

    async def _take(self, step: int):
        since = self.loop.time()
        while True:
            self.changed.clear()
            info = self.producer.try_take_batch(step, waiting_since=since)
            if info is not None:
                return info
            await self.changed.wait()

    async def train(self, steps: int) -> None:
        for step in range(steps):
            info = await self._take(step)
            tokens = self._tokens(info.groups)
            t = self.world.train_s(tokens)
            await asyncio.sleep(t)
            if self.sync_cfg.policy == "all_at_once":
                await self._sync_all(step + 1)
            else:
                self.stored = step + 1
                self.stored_event.set()
            self.batches.append((info, tokens))
            self.train_busy.append(t)
            self.step_ends.append(self.loop.time())
            for e in self.engines.values():
                e.catch_up()  # decode time up to now is counted
            self.engine_busy.append(sum(e.stats.busy_s for e in self.engines.values()))
            self.engine_work.append(
                (sum(e.stats.tokens for e in self.engines.values()), sum(e.stats.steps for e in self.engines.values()))
            )
            self.banked.append(self._banked_tokens())

    def _banked_tokens(self) -> int:
        return self._tokens(self.producer.state.buffer)

    def _tokens(self, groups) -> int:
        """Prompt + response tokens of `groups` (in tokens, not ids of token_unit tokens)."""
        return self.world.token_unit * sum(len(s.prompt_ids) + len(s.output_ids) for g in groups for s in g.samples)

    async def _sync_all(self, version: int) -> None:
        """all_at_once, as the loop does it inline: pause every server, load, continue, publish."""
        pause = self.sync_cfg.pause_generation
        for e in self.engines.values():
            if pause:
                if self.sync_cfg.pause_mode == "abort":
                    e.abort(None)
                e.pause()
        await asyncio.sleep(self.world.sync_s)
        for e in self.engines.values():
            e.set_version(version)
            if pause:
                e.resume()
        self.registry.publish_all(version, self.world.sync_s)
        self.producer.set_version(version)

    # ---- per-server sync (greedy / status_based), as megatron_dapo.sync.per_server does it -----
    async def per_server_sync(self) -> None:
        c = self.sync_cfg
        policy = make_sync_policy(c, clock=self.loop.time)
        interval = c.check_interval_ms / 1000.0
        while not self.stopping:  # a flag: wait_for (3.11) may swallow a cancel that meets a timeout
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stored_event.wait(), interval)
            self.stored_event.clear()
            if self.stored == 0:
                continue
            statuses = self.registry.statuses()
            if c.policy == "status_based":  # each lagging server's own load report
                for s in statuses:
                    if s.version < self.stored and not s.syncing:
                        row = self.engines[s.url].load()
                        s.running, s.waiting, s.throughput, s.kv_cache = (
                            row.running,
                            row.waiting,
                            row.throughput,
                            row.token_usage,
                        )
            for url in policy.choose(statuses, self.stored):
                self.registry.begin_sync(url)
                task = asyncio.get_running_loop().create_task(self._sync_one(url, self.stored))
                self.sync_tasks.add(task)
                task.add_done_callback(self.sync_tasks.discard)

    async def _sync_one(self, url: str, version: int) -> None:
        e, c = self.engines[url], self.sync_cfg
        if c.pause_generation:
            if c.pause_mode == "abort":
                e.abort(None)
            e.pause()
        draw = self.world.server_sync_s
        await asyncio.sleep(draw(list(self.engines).index(url)) if draw else self.world.sync_s)
        e.set_version(version)
        if c.pause_generation:
            e.resume()
        self.registry.end_sync(url, version)
        self.stored_event.set()  # a server freed: the policy may choose again
        self.producer.set_version(version)

    # ---- results -------------------------------------------------------------------------------
    def result(self, warmup: int, engines) -> SimResult:
        engines = list(engines)
        first = warmup - 1
        t0 = self.step_ends[first] if first >= 0 else 0.0
        busy0 = self.engine_busy[first] if first >= 0 else 0.0
        tokens0, steps0 = self.engine_work[first] if first >= 0 else (0, 0)
        banked_change = self.banked[-1] - (self.banked[first] if first >= 0 else 0)
        gen_tokens, gen_steps = self.engine_work[-1][0] - tokens0, self.engine_work[-1][1] - steps0
        wall = self.step_ends[-1] - t0
        measured = self.batches[warmup:]
        tokens = sum(t for _, t in measured)
        staleness = Counter()
        for info, _ in measured:
            staleness.update(info.staleness)
        n = max(1, sum(staleness.values()))
        return SimResult(
            steps=len(measured),
            wall_s=wall,
            tokens_per_s=tokens / wall if wall > 0 else 0.0,
            rollout_busy=(self.engine_busy[-1] - busy0) / (wall * len(engines)) if wall > 0 else 0.0,
            trainer_busy=sum(self.train_busy[warmup:]) / wall if wall > 0 else 0.0,
            mean_staleness=sum(k * v for k, v in staleness.items()) / n,
            max_staleness=max(staleness, default=0),
            step_s=wall / max(1, len(measured)),
            aborted_tokens=sum(e.stats.aborted_tokens for e in engines),
            regenerated_tokens=sum(info.tokens_regenerated for info, _ in self.batches) * self.world.token_unit,
            retractions=sum(e.stats.retractions for e in engines),
            migrations=sum(info.coordination.get("migrations", 0) for info, _ in self.batches[warmup:]),
            generated_per_s=gen_tokens / wall if wall > 0 else 0.0,
            banked_change=banked_change,
            produced_per_s=(tokens + banked_change) / wall if wall > 0 else 0.0,
            banked_draws=[g.draw for g in self.producer.state.buffer],
            mean_decode_batch=gen_tokens / gen_steps if gen_steps else 0.0,
            refusals=sum(info.coordination.get("routing_refusals", 0) for info, _ in measured),
            batches=[info for info, _ in self.batches],
            step_ends=list(self.step_ends),
        )
