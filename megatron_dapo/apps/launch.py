"""Placing a run's processes: Ray placement groups (default) or an existing torchrun group.

Ray: one placement group with a bundle per trainer rank and per launched rollout server. Server
actors start the servers (SGLang on GPUs, the embedded server on CPU) and report their URLs;
trainer actors get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT of rank 0's node)
and run `train_rank`; rank 0 starts the rollout coordinator as a named actor it owns (it dies with
rank 0; megatron_dapo.coordinator.process). On a CPU-only cluster bundles ask for fractions of a CPU so that the group
never asks for more CPUs than exist (Ray would wait forever).

torchrun: the ranks already exist; servers are the external `rollout.servers` of the config; rank 0
starts the coordinator as its subprocess.

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

from megatron_dapo.config import config_from_dict, config_to_dict
from megatron_dapo.config.derived import ray_max_restarts, trainer_world_size
from megatron_dapo.coordinator.restart import abort_every_request
from megatron_dapo.rollout.supervisor import ServerSupervisor
from megatron_dapo.runtime.net import free_port, interface_of, is_loopback
from megatron_dapo.sync.addresses import NODE_ADDRESS_ENV

# ray (and torch) are imported in the functions that use them: a torchrun launch never needs ray.

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


def refuse_unbuilt_placement(cfg) -> None:
    """`plan` and `simulate` know trainer.placement=colocated; a training run cannot use it yet."""
    if cfg.trainer.placement == "colocated":
        raise LaunchError(
            "trainer.placement=colocated: the colocated step cycle is not built yet (`megatron-dapo plan` and "
            "`simulate` estimate it); use trainer.placement=split"
        )


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

    def start(self, cfg_dict: dict, index: int, log_dir: str, model_path: str) -> str:
        import torch

        from megatron_dapo.rollout import launcher

        cfg = config_from_dict(cfg_dict)
        log_path = Path(log_dir) / f"server_{index}.log"
        if cfg.rollout.engine == "sglang":
            port = free_port(cfg.rollout.host)
            args = launcher.SGLangServerArgs.from_config(cfg, model_path, port, random_seed=index)
            self.proc = launcher.launch_sglang(args, log_path)
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

    refuse_unbuilt_placement(cfg)
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


def _train_ranks(cfg, layout, trainers, urls, tp_sizes, resume: bool):
    """Run the trainer actors; rank 0's RunResult, or the first rank's failure as soon as it happens (the
    others may wait for the failed one in a collective forever)."""
    import ray

    master_addr, master_port = ray.get(trainers[0].node_address.remote())
    cfg_dict = config_to_dict(cfg)
    futures = [
        t.run.remote(cfg_dict, layout.rank_env(r, master_addr, master_port), urls, tp_sizes, resume)
        for r, t in enumerate(trainers)
    ]
    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises the rank's exception (RayTaskError) or its death (RayActorError)
    return ray.get(futures[0])


def restartable(error: BaseException) -> bool:
    """Whether restarting the trainer ranks may get past `error`: a rank that died or raised during training,
    not a run that cannot start (bad config, data or checkpoint: the same again on every restart)."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.errors import CheckpointError
    from megatron_dapo.trainer.loop import RunSetupError

    cause = getattr(error, "cause", None) or error  # a Ray task error carries the rank's own exception
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
        ray.init(address=cfg.trainer.ray_address, include_dashboard=False)
    else:
        _local_ray_init(cfg.trainer.bind_host)
    return True


class _RayLayout:
    """One placement-group bundle per trainer rank, then one per launched server (GPUs when Ray has
    them, else an even share of the CPUs)."""

    def __init__(self, cfg, world: int, n_servers: int, gpu: bool, trainer_bundle: dict, server_bundle: dict):
        self.cfg, self.world, self.n_servers, self.gpu = cfg, world, n_servers, gpu
        self.trainer_bundle, self.server_bundle = trainer_bundle, server_bundle
        self.env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} if not gpu else {}
        self.env.update(_gloo_env(cfg))

    @classmethod
    def for_run(cls, cfg, world: int, n_servers: int) -> "_RayLayout":
        import ray
        import torch

        gpu = torch.cuda.is_available() and ray.cluster_resources().get("GPU", 0) > 0
        if gpu:
            server_gpus = cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1
            return cls(cfg, world, n_servers, gpu, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": server_gpus})
        share = min(1.0, ray.cluster_resources().get("CPU", 1) / (world + n_servers))
        return cls(cfg, world, n_servers, gpu, {"CPU": share}, {"CPU": share})

    def place(self):
        import ray
        from ray.util.placement_group import placement_group

        bundles = [dict(self.trainer_bundle) for _ in range(self.world)]
        bundles += [dict(self.server_bundle) for _ in range(self.n_servers)]
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=120)
        except Exception as e:
            raise LaunchError(
                f"Ray could not place {len(bundles)} bundles {bundles} (cluster: {ray.cluster_resources()}): {e}"
            ) from e
        return pg

    def _options(self, pg, index: int, bundle: dict) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        return dict(
            scheduling_strategy=strategy,
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            runtime_env={"env_vars": self.env},
        )

    def start_servers(self, cfg, pg) -> tuple[list, list[str]]:
        """The launched servers (after the trainer bundles) and every server URL, external ones first."""
        import ray

        log_dir = Path(cfg.logging.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        actor = ray.remote(_ServerActor)
        servers = [
            actor.options(**self._options(pg, self.world + i, self.server_bundle)).remote()
            for i in range(self.n_servers)
        ]
        cfg_dict = config_to_dict(cfg)
        from megatron_dapo.rollout.launcher import rollout_model_path

        model = rollout_model_path(cfg) if servers else cfg.model.hf_path  # an FP8 copy with fp8_block
        started = ray.get([s.start.remote(cfg_dict, i, str(log_dir), model) for i, s in enumerate(servers)])
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


def _gloo_env(cfg) -> dict:
    """gloo (CPU runs; megatron-core's helper groups on GPU) listens on the address the host name
    resolves to, often the external one, unless GLOO_SOCKET_IFNAME names an interface. On a local
    cluster bound to loopback every rank and server is on this machine: loopback's interface."""
    if cfg.trainer.ray_address or "GLOO_SOCKET_IFNAME" in os.environ or not is_loopback(cfg.trainer.bind_host):
        return {}
    name = interface_of(cfg.trainer.bind_host)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


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

    refuse_unbuilt_placement(cfg)
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
