"""Placing a run's processes: Ray placement groups (default) or an existing torchrun group.

Ray: one placement group with a bundle per trainer rank and per launched rollout server. Server
actors start the servers (SGLang on GPUs, the embedded server on CPU) and report their URLs;
trainer actors get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT of rank 0's node)
and run `train_rank`; rank 0 starts the rollout coordinator as a named actor it owns (it dies with
rank 0; megatron_dapo.coordinator.process). On a CPU-only cluster bundles ask for fractions of a CPU so that the group
never asks for more CPUs than exist (Ray would wait forever). On a cluster whose Ray nodes carry the label
NODE_LABEL (launch/slurm_ray.sbatch sets it: node k of the allocation is "k"), each bundle is pinned to the
node `megatron-dapo plan` puts its process on (megatron_dapo.planner.plan.plan_layout): trainer rank r on node
r // trainer.gpus_per_node, servers as the plan says; without the labels Ray packs the bundles itself.

torchrun: the ranks already exist; servers are the external `rollout.servers` of the config; rank 0
starts the coordinator as its subprocess.

trainer.placement=colocated (docs/placement.md): under Ray each trainer rank's bundle also holds its share
of a server (`_RayLayout`); under torchrun the ranks launch the servers themselves, one per
rollout.server_tp ranks of a node (`torchrun_colocated_servers`). SGLang servers get --enable-memory-saver.

`rollout.relaunch`: under Ray a supervisor thread of the driver relaunches a launched server whose
process exited (megatron_dapo.rollout.supervisor); external servers, the only ones under torchrun, are
never relaunched here (a log line says so), but are re-admitted once they answer again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from megatron_dapo.config import config_from_dict, config_to_dict, derived
from megatron_dapo.config.derived import ray_max_restarts, trainer_world_size
from megatron_dapo.coordinator.restart import abort_every_request
from megatron_dapo.rollout.supervisor import ServerSupervisor
from megatron_dapo.runtime.net import free_port, interface_of, is_loopback
from megatron_dapo.sync.addresses import NODE_ADDRESS_ENV

# ray (and torch) are imported in the functions that use them: a torchrun launch never needs ray.

log = logging.getLogger(__name__)


# The Ray node label naming a node's index in the job (0 = the head); set by launch/slurm_ray.sbatch.
NODE_LABEL = "megatron-dapo/node"


class LaunchError(RuntimeError):
    pass


def _local_ray_init(bind_host: str):
    """A local Ray cluster whose node address is `bind_host`, no dashboard, all of this machine's CPUs."""
    import ray

    if not is_loopback(bind_host) and interface_of(bind_host) is None:
        raise LaunchError(
            f"trainer.bind_host={bind_host} is not an address of this machine's interfaces: "
            f"a local Ray cluster cannot listen there"
        )
    with _ray_single_machine(is_loopback(bind_host)):
        ray.init(
            address="local",  # a new cluster even where `ray start` left one (ray.init() would join it)
            _node_ip_address=bind_host,
            include_dashboard=False,
            num_cpus=os.cpu_count() or 1,
            log_to_driver=True,
            configure_logging=False,
        )


@contextlib.contextmanager
def _ray_single_machine(on: bool):
    """Ray's single-machine mode while a local cluster starts, when `on`.

    Ray 2.60 replaces a loopback node address (`ray.init(_node_ip_address=...)`, `ray start
    --node-ip-address`) by this machine's external one (`services.resolve_ip_for_localhost`); its GCS,
    raylet and workers then listen on every interface, its runtime-env agent on the external address.
    Only with its single-machine switch off does it keep 127.0.0.1, and then every one of them listens
    on loopback. The switch's public spelling, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, is read once when
    ray is first imported (too early for a driver that imported ray before), so the constant it sets,
    `ray._private.ray_constants.ENABLE_RAY_CLUSTER` (private), is switched here, and only while
    `ray.init` runs.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    if on:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


class _ServerActor:
    """Owns one rollout server process."""

    def start(self, cfg_dict: dict, index: int, log_dir: str, model_path: str, cuda_devices: str | None = None) -> str:
        """`model_path`: the checkpoint to serve (`rollout_model_path`); `cuda_devices`: the GPUs of a colocated
        TP > 1 server (its trainer ranks'), else Ray's assignment."""
        import torch

        from megatron_dapo.rollout import launcher

        cfg = config_from_dict(cfg_dict)
        log_path = Path(log_dir) / f"server_{index}.log"
        if cfg.rollout.engine == "sglang":
            port = free_port(cfg.rollout.host)
            args = launcher.SGLangServerArgs.from_config(cfg, model_path, port, random_seed=index)
            env = {"CUDA_VISIBLE_DEVICES": cuda_devices} if cuda_devices else None
            self.proc = launcher.launch_sglang(args, log_path, env=env)
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            options = launcher.embedded_options(cfg, device)
            self.proc = launcher.launch_embedded(model_path, log_path, seed=index, **options)
        self.start_timeout_s = 1200.0 if cfg.rollout.engine == "sglang" else 300.0
        return self.proc.url

    def alive(self) -> bool:
        return self.proc.alive()

    def restart(self) -> None:
        """Its process again, on its port (rollout.relaunch); returns once healthy."""
        self.proc.restart(self.start_timeout_s)

    def stop(self) -> None:
        if getattr(self, "proc", None) is not None:
            self.proc.stop()


class _RayServerHandle:
    """A launched server as the supervisor (megatron_dapo.rollout.supervisor) watches it: through its actor."""

    def __init__(self, actor, url: str):
        self.actor, self.url = actor, url

    def alive(self) -> bool:
        import ray

        return ray.get(self.actor.alive.remote(), timeout=60)

    def restart(self) -> None:
        import ray

        ray.get(self.actor.restart.remote())


class _TrainerActor:
    def gpu_ids(self) -> tuple[str, list[str]]:
        """This actor's node and the GPU ids Ray gave it (as CUDA_VISIBLE_DEVICES spells them)."""
        import ray

        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def node_address(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def run(self, cfg_dict: dict, env: dict, urls: list[str], tp_sizes: list[int], resume: bool):
        import ray

        os.environ.update({k: str(v) for k, v in env.items()})
        # where this rank hosts a weight-update group of its own (per_stage sources): its node's Ray address
        os.environ.setdefault(NODE_ADDRESS_ENV, ray.util.get_node_ip_address())
        from megatron_dapo.trainer.loop import train_rank

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return train_rank(config_from_dict(cfg_dict), urls, tp_sizes, resume=resume)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in the driver, so that `finally` blocks stop the servers and
    the Ray actors it started (Python's default SIGTERM handling skips them)."""

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_with_ray(cfg, resume: bool = False):
    """Place servers and trainer ranks with Ray; run; return rank 0's RunResult."""
    import ray
    from ray.util.placement_group import remove_placement_group

    exit_on_sigterm()
    started = _init_ray(cfg)
    world = trainer_world_size(cfg)
    n_servers = 0 if cfg.rollout.servers else cfg.rollout.num_servers
    layout = _RayLayout.for_run(cfg, world, n_servers)
    pg = layout.place()
    servers, trainers, supervisor = [], [], None
    try:
        servers, urls = layout.start_servers(cfg, pg)
        launched_urls = urls[len(cfg.rollout.servers) :]  # external ones first
        supervisor = _supervise(cfg, [_RayServerHandle(s, u) for s, u in zip(servers, launched_urls)])
        tp_sizes = [cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1] * len(urls)
        max_restarts = ray_max_restarts(cfg)
        for restart in range(max_restarts + 1):
            trainers = layout.start_trainers(pg)
            try:
                return _train_ranks(cfg, layout, trainers, urls, tp_sizes, resume)
            except Exception as e:
                if not restartable(e) or restart == max_restarts:
                    e.add_note(f"trainer ranks restarted {restart} time(s) (trainer.max_restarts={max_restarts})")
                    raise
                log.warning(
                    "a trainer rank failed (%s): restart %d of %d from the latest checkpoint",
                    e,
                    restart + 1,
                    max_restarts,
                )
            finally:
                for t in trainers:  # the survivors wait in a collective for the dead one: never returning
                    ray.kill(t)
            abort_every_request(urls, cfg.rollout.api_key)  # the dead rank 0's coordinator was generating
            resume = True
    finally:
        if supervisor is not None:  # first: it would relaunch the servers stopped next
            supervisor.stop()
        _stop_actors(servers, trainers)
        remove_placement_group(pg)
        if started:
            ray.shutdown()


class TrainerRankLost(LaunchError):
    """A trainer rank's Ray actor died or became unreachable (its process, or its whole node, is gone)."""


PLACE_TIMEOUT_S = 300.0  # for the trainer actors of a (re)start to be placed and answer


# After a rank raises, how long the driver waits for another rank to be found lost before it reports the raise:
# a rank whose peer was SIGKILLed often fails first (its collective's connection is reset) while Ray is still
# noticing the death (at once for a process, a node heartbeat timeout of 30 s for a whole node; longer on a
# loaded machine), and the lost rank, not the reset, is what the operator must be told and what a restart is for.
LOST_PEER_GRACE_S = 40.0


def _rank_results(futures: list, layout: "_RayLayout", grace_s: float = LOST_PEER_GRACE_S) -> list:
    """Every rank's result; the first rank whose actor is lost (its process or its node gone) raises
    TrainerRankLost at once, naming the rank and its node, instead of the others waiting on it. A rank that
    raises is reported as itself only when no other rank is found lost within `grace_s`."""
    import ray

    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except _lost_actor_errors() as e:
            raise _rank_lost(futures.index(done[0]), layout, e) from e
        except Exception as raised:
            found = _lost_rank_within(pending, grace_s)
            if found is None:
                raise
            ref, e = found
            rank = futures.index(ref)
            raise _rank_lost(rank, layout, e, after=f"rank {futures.index(done[0])} failed first: {raised!r}") from e
    return ray.get(futures)


def _lost_actor_errors() -> tuple:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, WorkerCrashedError

    return (ActorDiedError, ActorUnavailableError, NodeDiedError, WorkerCrashedError)


def _lost_rank_within(pending: list, grace_s: float):
    """(ref, error) of the first of `pending` found lost within grace_s, else None (ranks that raise or return
    meanwhile are passed over: they are the first failure's consequences or bystanders)."""
    import time

    import ray

    deadline = time.monotonic() + grace_s
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except _lost_actor_errors() as e:
                return ref, e
            except Exception:
                pass
    return None


def _rank_lost(rank: int, layout: "_RayLayout", e: BaseException, after: str = "") -> "TrainerRankLost":
    also = f" ({after.splitlines()[0][:300]})" if after else ""
    return TrainerRankLost(
        f"trainer rank {rank} lost ({layout.where(rank)}): {type(e).__name__}: {str(e).splitlines()[0]}{also}; "
        f"the run stops (resume from the latest checkpoint with checkpoint.resume=true)"
    )


def _train_ranks(cfg, layout, trainers, urls, tp_sizes, resume: bool):
    """Run the trainer actors; rank 0's RunResult, or the first rank's failure as soon as it happens (the
    others may wait for the failed one in a collective forever)."""
    import ray

    try:  # a restart after a lost node may find no room for a rank: bounded, never a hang
        master_addr, master_port = ray.get(trainers[0].node_address.remote(), timeout=PLACE_TIMEOUT_S)
        ray.get([t.node_address.remote() for t in trainers[1:]], timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as e:
        raise TrainerRankLost(
            f"the trainer ranks did not all start within {PLACE_TIMEOUT_S:.0f} s (a node lost, or no room left "
            f"for a rank of the placement group: {layout.where(0)} ...); resume from the latest checkpoint "
            f"with checkpoint.resume=true once the cluster has room"
        ) from e
    cfg_dict = config_to_dict(cfg)
    futures = [
        t.run.remote(cfg_dict, layout.rank_env(r, master_addr, master_port), urls, tp_sizes, resume)
        for r, t in enumerate(trainers)
    ]
    return _rank_results(futures, layout)[0]


def restartable(error: BaseException) -> bool:
    """Whether restarting the trainer ranks may get past `error`: a rank that died or raised during training,
    not a run that cannot start (bad config, data or checkpoint: the same again on every restart)."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.errors import CheckpointError
    from megatron_dapo.trainer.loop import RunSetupError

    cause = getattr(error, "cause", None) or error  # a Ray task error carries the rank's own exception
    if isinstance(cause, TrainerRankLost):  # a rank's process died: what a restart is for
        return True
    return not isinstance(cause, (RunSetupError, ConfigError, CheckpointError, LaunchError))


def elastic_restart(cfg) -> int:
    """Under torchrun: which restart of the ranks this is (torchrun's elastic agent restarts them all when one
    fails, `--max-restarts` times); a restart resumes from the latest checkpoint. A trainer.max_restarts that
    differs from torchrun's is a LaunchError naming both (None: torchrun's)."""
    agent_max, want = os.environ.get("TORCHELASTIC_MAX_RESTARTS"), cfg.trainer.max_restarts
    if agent_max is not None and want is not None and int(agent_max) != want:
        raise LaunchError(
            f"trainer.max_restarts={cfg.trainer.max_restarts}, but torchrun restarts the ranks {agent_max} times: "
            f"start torchrun with --max-restarts={cfg.trainer.max_restarts}, or set trainer.max_restarts={agent_max}"
        )
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


EXTERNAL_ONLY = (
    "rollout.relaunch: this run launched no rollout server (rollout.servers are external), so none is "
    "relaunched here; a lost one that answers /health again at its URL is re-admitted at the next weight sync"
)


def _supervise(cfg, launched: list) -> ServerSupervisor | None:
    """Started: the supervisor relaunching the servers this run launched (rollout.relaunch); else None."""
    if not cfg.rollout.relaunch:
        return None
    if not launched:
        log.info(EXTERNAL_ONLY)
        return None
    return ServerSupervisor(launched, cfg.rollout.relaunch_max).start()


def _init_ray(cfg) -> bool:
    """Connect to trainer.ray_address or start a local Ray; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.trainer.ray_address:
        # a cluster on loopback (launch/slurm_ray.sbatch with HEAD_IP=127.0.0.1) is reached there, not at
        # the external address Ray would put in its place
        host = _ray_host(cfg.trainer.ray_address)
        with _ray_single_machine(bool(host) and is_loopback(host)):
            ray.init(address=cfg.trainer.ray_address, include_dashboard=False)
    else:
        _local_ray_init(cfg.trainer.bind_host)
    return True


class _RayLayout:
    """One placement-group bundle per trainer rank, then one per launched server (GPUs when Ray has
    them, else an even share of the CPUs). trainer.placement=colocated: one bundle per trainer rank only,
    holding the rank and its share of a server: server i runs in the bundle of trainer rank
    i * rollout.server_tp, each actor taking half of the bundle's GPU (the two take turns on it); an SGLang
    server with TP > 1 is given the GPUs of its server_tp ranks' bundles (`server_gpus`)."""

    def __init__(self, cfg, world: int, n_servers: int, gpu: bool, trainer_bundle: dict, server_bundle: dict):
        self.cfg, self.world, self.n_servers, self.gpu = cfg, world, n_servers, gpu
        self.trainer_bundle, self.server_bundle = trainer_bundle, server_bundle  # each actor's resources
        self.colocated = derived.colocated(cfg)
        self.env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} if not gpu else {}
        self.env.update(_gloo_env(cfg))
        self.bundle_nodes: list[str] = []  # per bundle, once placed: "Ray node ID, NODE_LABEL=K"

    @classmethod
    def for_run(cls, cfg, world: int, n_servers: int) -> "_RayLayout":
        import ray
        import torch

        gpu = torch.cuda.is_available() and ray.cluster_resources().get("GPU", 0) > 0
        if gpu and derived.colocated(cfg):
            return cls(cfg, world, n_servers, gpu, {"CPU": 1, "GPU": 0.5}, {"CPU": 1, "GPU": 0.5})
        if gpu:
            server_gpus = cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1
            return cls(cfg, world, n_servers, gpu, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": server_gpus})
        share = min(1.0, ray.cluster_resources().get("CPU", 1) / (world + n_servers))
        return cls(cfg, world, n_servers, gpu, {"CPU": share}, {"CPU": share})

    def bundles(self) -> list[dict]:
        if self.colocated:  # a trainer rank and its share of a server: the sum of the two actors'
            return [{k: v + self.server_bundle.get(k, 0) for k, v in self.trainer_bundle.items()}] * self.world
        return [dict(self.trainer_bundle)] * self.world + [dict(self.server_bundle)] * self.n_servers

    def server_bundle_index(self, i: int) -> int:
        if self.colocated:
            return i * max(1, self.cfg.rollout.server_tp)
        return self.world + i

    def place(self):
        import ray
        from ray.util.placement_group import placement_group

        bundles = [dict(b) for b in self.bundles()]
        # colocated: a server shares its trainer ranks' bundles, so only the trainer ranks are placed by node
        selectors = planned_nodes(self.cfg, 0 if self.colocated else self.n_servers, _labelled_nodes())
        if selectors is not None:
            selectors = [{NODE_LABEL: str(node)} for node in selectors]
            log.info("placing trainer ranks and servers on the planned nodes (label %s): %s", NODE_LABEL, selectors)
        pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
        try:
            ray.get(pg.ready(), timeout=120)
        except Exception as e:
            raise LaunchError(
                f"Ray could not place {len(bundles)} bundles {bundles} on nodes {selectors} "
                f"(cluster: {ray.cluster_resources()}): {e}"
            ) from e
        self._log_placement(pg)
        return pg

    def _log_placement(self, pg) -> None:
        """One line per bundle: the Ray node (and its NODE_LABEL) that holds a trainer rank or a server."""
        import ray
        from ray.util.placement_group import placement_group_table

        labels = {n["NodeID"]: (n.get("Labels") or {}).get(NODE_LABEL, "-") for n in ray.nodes()}
        where = placement_group_table(pg).get("bundles_to_node_id", {})
        self.bundle_nodes = [
            f"Ray node {where.get(i)}, {NODE_LABEL}={labels.get(where.get(i), '-')}" for i in range(len(self.bundles()))
        ]
        placed = [(f"trainer rank {r}", r) for r in range(self.world)]
        placed += [(f"rollout server {i}", self.server_bundle_index(i)) for i in range(self.n_servers)]
        for what, bundle in placed:
            log.info("%s placed on %s", what, self.bundle_nodes[bundle].replace(", ", " (", 1) + ")")

    def where(self, bundle: int) -> str:
        """The node of a bundle (a trainer rank's index is its bundle's), as placed."""
        return self.bundle_nodes[bundle] if bundle < len(self.bundle_nodes) else "node unknown"

    def _options(self, pg, index: int, bundle: dict) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        return dict(
            scheduling_strategy=strategy,
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            runtime_env={"env_vars": self.env},
        )

    def server_gpus(self, pg) -> list[str | None]:
        """Colocated SGLang servers with TP > 1 on GPUs: each server's CUDA_VISIBLE_DEVICES, the GPUs of its
        server_tp trainer ranks' bundles (asked of a probe actor in each; a bundle keeps its GPU for the
        group's life, so restarted trainer ranks land on the same ones). None: Ray's own assignment."""
        import ray

        tp = self.cfg.rollout.server_tp
        if not (self.colocated and self.gpu and self.cfg.rollout.engine == "sglang" and tp > 1):
            return [None] * self.n_servers
        probe = ray.remote(_TrainerActor)
        actors = [probe.options(**self._options(pg, r, self.trainer_bundle)).remote() for r in range(self.world)]
        try:
            where = ray.get([a.gpu_ids.remote() for a in actors])
        finally:
            for a in actors:
                ray.kill(a)
        out = []
        for i in range(self.n_servers):
            ranks = where[i * tp : (i + 1) * tp]
            if len({node for node, _ in ranks}) != 1:
                raise LaunchError(
                    f"trainer.placement=colocated: server {i}'s {tp} trainer ranks ({i * tp}..{(i + 1) * tp - 1}) "
                    f"were placed on different nodes {sorted({n for n, _ in ranks})}; a server's GPUs share a node"
                )
            out.append(",".join(g for _, ids in ranks for g in ids))
        return out

    def start_servers(self, cfg, pg) -> tuple[list, list[str]]:
        """The launched servers (after the trainer bundles) and every server URL, external ones first."""
        import ray

        log_dir = Path(cfg.logging.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        gpus = self.server_gpus(pg)
        actor = ray.remote(_ServerActor)
        servers = [
            actor.options(**self._options(pg, self.server_bundle_index(i), self.server_bundle)).remote()
            for i in range(self.n_servers)
        ]
        cfg_dict = config_to_dict(cfg)
        from megatron_dapo.rollout.launcher import rollout_model_path

        model = rollout_model_path(cfg) if servers else cfg.model.hf_path  # an FP8 copy with fp8_block
        started = ray.get([s.start.remote(cfg_dict, i, str(log_dir), model, gpus[i]) for i, s in enumerate(servers)])
        return servers, list(cfg.rollout.servers) + started

    def start_trainers(self, pg) -> list:
        import ray

        actor = ray.remote(_TrainerActor)
        return [actor.options(**self._options(pg, r, self.trainer_bundle)).remote() for r in range(self.world)]

    def rank_env(self, rank: int, master_addr: str, master_port: int) -> dict:
        return {
            "RANK": rank,
            "WORLD_SIZE": self.world,
            "LOCAL_RANK": 0 if self.gpu else rank,
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": master_port,
        }


def planned_nodes(cfg, n_servers: int, labelled: set[str]) -> list[int] | None:
    """The node of each bundle (trainer ranks, then launched servers) as `megatron-dapo plan` places them,
    or None when the Ray nodes do not carry NODE_LABEL for every node of the plan (Ray packs the bundles)."""
    from megatron_dapo.planner.plan import plan_layout

    if cfg.trainer.nnodes < 2 or not {str(k) for k in range(cfg.trainer.nnodes)} <= labelled:
        return None
    layout = plan_layout(cfg)
    return [node for node, _ in layout.trainer_gpus] + layout.server_nodes[:n_servers]


def _labelled_nodes() -> set[str]:
    """The NODE_LABEL values of the alive Ray nodes."""
    import ray

    return {n["Labels"][NODE_LABEL] for n in ray.nodes() if n.get("Alive") and NODE_LABEL in (n.get("Labels") or {})}


def _gloo_env(cfg) -> dict:
    """gloo (CPU runs; megatron-core's helper groups on GPU) listens on the address the host name
    resolves to, often the external one, unless GLOO_SOCKET_IFNAME names an interface. On a local
    cluster bound to loopback, or a Ray cluster on loopback (every node on this machine), every rank and
    server is on this machine: loopback's interface."""
    host = _ray_host(cfg.trainer.ray_address) if cfg.trainer.ray_address else cfg.trainer.bind_host
    if "GLOO_SOCKET_IFNAME" in os.environ or not host or not is_loopback(host):
        return {}
    name = interface_of(host)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


def _ray_host(address: str) -> str:
    """The host of a Ray address `HOST:PORT`; "" for a host name (never loopback here: Ray resolves it)."""
    host = address.rpartition(":")[0] or address
    try:
        is_loopback(host)
    except ValueError:
        return ""
    return host


def _stop_actors(servers: list, trainers: list) -> None:
    import ray

    for s in servers:
        try:
            ray.get(s.stop.remote(), timeout=60)
        except Exception as e:  # the process group kill below still reaps it
            log.warning("stopping a rollout server failed: %s", e)
    for a in servers + trainers:
        ray.kill(a)


def run_with_torchrun(cfg, resume: bool = False):
    """Inside a torchrun group: every rank trains; the servers are `rollout.servers`."""
    from megatron_dapo.trainer.loop import train_rank

    if derived.colocated(cfg):
        return _run_colocated_with_torchrun(cfg, resume)
    if not cfg.rollout.servers:
        raise LaunchError(
            "trainer.launcher=torchrun needs rollout.servers: the URLs of running rollout servers "
            "(start them with `megatron-dapo serve` or SGLang), e.g. "
            "rollout.servers='[\"http://127.0.0.1:30000\"]'"
        )
    if cfg.rollout.relaunch:
        log.info(EXTERNAL_ONLY)
    if restart := elastic_restart(cfg):
        log.warning("torchrun restart %d: resuming from the latest checkpoint", restart)
        resume = True
    tp = cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1
    return train_rank(cfg, list(cfg.rollout.servers), [tp] * len(cfg.rollout.servers), resume=resume)


def _run_colocated_with_torchrun(cfg, resume: bool):
    from megatron_dapo.trainer.loop import train_rank

    if cfg.rollout.relaunch:
        log.info(TORCHRUN_COLOCATED_NO_RELAUNCH)
    if restart := elastic_restart(cfg):
        log.warning("torchrun restart %d: resuming from the latest checkpoint", restart)
        resume = True
    tp = cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1
    with torchrun_colocated_servers(cfg) as urls:
        return train_rank(cfg, urls, [tp] * len(urls), resume=resume)


TORCHRUN_COLOCATED_NO_RELAUNCH = (
    "rollout.relaunch: under torchrun the colocated servers are the ranks' own subprocesses and are not "
    "relaunched; a lost one is left out (rollout.min_healthy_servers), as with external servers"
)


@contextlib.contextmanager
def torchrun_colocated_servers(cfg):
    """trainer.placement=colocated under torchrun: the ranks launch the servers themselves, one per
    rollout.server_tp consecutive ranks of a node (node-local rank % server_tp == 0 launches it on its own
    and the next server_tp - 1 GPUs: SGLang's --base-gpu-id, with --enable-memory-saver), and every rank gets
    every server's URL, in rank order. Each server stops with its rank. Collective (the default group)."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.rollout import launcher
    from megatron_dapo.runtime.distributed import init_distributed

    info = init_distributed()
    tp = max(1, cfg.rollout.server_tp)
    model = [None]  # what the servers start from: rank 0 writes an FP8 copy once with fp8_block
    if info.rank == 0:
        try:
            model = [("path", launcher.rollout_model_path(cfg))]
        except Exception as e:  # the others wait in the broadcast below: they must hear of it
            model = [("error", f"rank 0: the servers' checkpoint could not be written ({e})")]
    dist.broadcast_object_list(model, src=0)
    if model[0][0] == "error":
        raise LaunchError("trainer.placement=colocated: " + model[0][1])
    model_path = model[0][1]
    proc, answer = None, None
    if info.local_rank % tp == 0:
        index = info.rank // tp
        log_path = Path(cfg.logging.run_dir) / "logs" / f"server_{index}.log"
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            if cfg.rollout.engine == "sglang":
                port = free_port(cfg.rollout.host)
                args = launcher.SGLangServerArgs.from_config(
                    cfg, model_path, port, random_seed=index, base_gpu_id=info.local_rank
                )
                proc = launcher.launch_sglang(args, log_path)
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                proc = launcher.launch_embedded(
                    model_path, log_path, seed=index, **launcher.embedded_options(cfg, device)
                )
            answer = ("url", proc.url)
        except Exception as e:  # every rank must reach the gather below, or the others wait forever
            answer = ("error", f"rank {info.rank}: server {index} did not start ({e}); its log: {log_path}")
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, answer)
    try:
        errors = [a[1] for a in answers if a is not None and a[0] == "error"]
        if errors:
            raise LaunchError("trainer.placement=colocated: " + "; ".join(errors))
        yield [a[1] for a in answers if a is not None]
    finally:
        if proc is not None:
            proc.stop()
