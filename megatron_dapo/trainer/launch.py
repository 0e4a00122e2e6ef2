"""Placing a run's processes: Ray placement groups (default) or an existing torchrun group.

Ray: one placement group with a bundle per trainer rank and per launched rollout server. Server
actors start the servers (SGLang on GPUs, the embedded server on CPU) and report their URLs;
trainer actors get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT of rank 0's node)
and run `train_rank`; rank 0 starts the rollout coordinator as a named actor it owns (it dies with
rank 0; megatron_dapo.coordinator.process). On a CPU-only cluster bundles ask for fractions of a CPU so that the group
never asks for more CPUs than exist (Ray would wait forever).

torchrun: the ranks already exist; servers are the external `rollout.servers` of the config; rank 0
starts the coordinator as its subprocess.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from megatron_dapo.config import config_from_dict, config_to_dict
from megatron_dapo.config.derived import trainer_world_size
from megatron_dapo.runtime.net import free_port

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


def _local_ray_init():
    import ray

    # Loopback only (CI machines reach nothing else), no dashboard; all of this machine's CPUs.
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=os.cpu_count() or 1,
        log_to_driver=True,
        configure_logging=False,
    )


class _ServerActor:
    """Owns one rollout server process."""

    def start(self, cfg_dict: dict, index: int, log_dir: str) -> str:
        import torch

        from megatron_dapo.rollout import launcher

        cfg = config_from_dict(cfg_dict)
        log_path = Path(log_dir) / f"server_{index}.log"
        if cfg.rollout.engine == "sglang":
            args = launcher.SGLangServerArgs.from_config(cfg, cfg.model.hf_path, free_port(), random_seed=index)
            self.proc = launcher.launch_sglang(args, log_path)
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.proc = launcher.launch_embedded(
                cfg.model.hf_path,
                log_path,
                api_key=cfg.rollout.api_key,
                seed=index,
                device=device,
                deterministic_inference=cfg.rollout.deterministic_inference,
                batching=cfg.rollout.embedded_batching,
            )
        return self.proc.url

    def stop(self) -> None:
        if getattr(self, "proc", None) is not None:
            self.proc.stop()


class _TrainerActor:
    def node_address(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def run(self, cfg_dict: dict, env: dict, urls: list[str], tp_sizes: list[int], resume: bool):
        os.environ.update({k: str(v) for k, v in env.items()})
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
    import torch
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    exit_on_sigterm()
    started = False
    if not ray.is_initialized():
        if cfg.trainer.ray_address:
            ray.init(address=cfg.trainer.ray_address, include_dashboard=False)
        else:
            _local_ray_init()
        started = True
    cfg_dict = config_to_dict(cfg)
    world = trainer_world_size(cfg)
    external = list(cfg.rollout.servers)
    n_servers = 0 if external else cfg.rollout.num_servers
    gpu = torch.cuda.is_available() and ray.cluster_resources().get("GPU", 0) > 0
    if gpu:
        trainer_bundle = {"CPU": 1, "GPU": 1}
        server_bundle = {"CPU": 1, "GPU": cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1}
    else:
        cpus = ray.cluster_resources().get("CPU", 1)
        share = min(1.0, cpus / (world + n_servers))
        trainer_bundle = server_bundle = {"CPU": share}
    bundles = [dict(trainer_bundle) for _ in range(world)] + [dict(server_bundle) for _ in range(n_servers)]
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=120)
    except Exception as e:
        raise LaunchError(
            f"Ray could not place {len(bundles)} bundles {bundles} (cluster: {ray.cluster_resources()}): {e}"
        ) from e
    env_common = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} if not gpu else {}
    run_dir = Path(cfg.logging.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    ServerActor = ray.remote(_ServerActor)
    TrainerActor = ray.remote(_TrainerActor)

    def strategy(i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    servers, trainers = [], []
    try:
        servers = [
            ServerActor.options(
                scheduling_strategy=strategy(world + i),
                num_cpus=server_bundle["CPU"],
                num_gpus=server_bundle.get("GPU", 0),
                runtime_env={"env_vars": env_common},
            ).remote()
            for i in range(n_servers)
        ]
        urls = external + ray.get([s.start.remote(cfg_dict, i, str(run_dir / "logs")) for i, s in enumerate(servers)])
        tp_sizes = [cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1] * len(urls)
        trainers = [
            TrainerActor.options(
                scheduling_strategy=strategy(r),
                num_cpus=trainer_bundle["CPU"],
                num_gpus=trainer_bundle.get("GPU", 0),
                runtime_env={"env_vars": env_common},
            ).remote()
            for r in range(world)
        ]
        master_addr, master_port = ray.get(trainers[0].node_address.remote())
        futures = [
            t.run.remote(
                cfg_dict,
                {
                    "RANK": r,
                    "WORLD_SIZE": world,
                    "LOCAL_RANK": 0 if gpu else r,
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": master_port,
                },
                urls,
                tp_sizes,
                resume,
            )
            for r, t in enumerate(trainers)
        ]
        results = ray.get(futures)
        return results[0]
    finally:
        for s in servers:
            try:
                ray.get(s.stop.remote(), timeout=60)
            except Exception as e:  # the process group kill below still reaps it
                log.warning("stopping a rollout server failed: %s", e)
        for a in servers + trainers:
            ray.kill(a)
        remove_placement_group(pg)
        if started:
            ray.shutdown()


def run_with_torchrun(cfg, resume: bool = False):
    """Inside a torchrun group: every rank trains; the servers are `rollout.servers`."""
    from megatron_dapo.trainer.loop import train_rank

    if not cfg.rollout.servers:
        raise LaunchError(
            "trainer.launcher=torchrun needs rollout.servers: the URLs of running rollout servers "
            "(start them with `megatron-dapo serve` or SGLang), e.g. "
            "rollout.servers='[\"http://127.0.0.1:30000\"]'"
        )
    tp = cfg.rollout.server_tp if cfg.rollout.engine == "sglang" else 1
    return train_rank(cfg, list(cfg.rollout.servers), [tp] * len(cfg.rollout.servers), resume=resume)
