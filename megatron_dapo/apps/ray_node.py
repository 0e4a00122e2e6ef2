"""Ray's own CLI (`ray start`, `ray status`, ...) for a Ray cluster on loopback: several Ray nodes on one
machine, every process listening on 127.0.0.1 (launch/slurm_ray.sbatch with HEAD_IP=127.0.0.1, as the tests run it):
`python -m megatron_dapo.apps.ray_node start --address=127.0.0.1:PORT --node-ip-address=127.0.0.1 ...`.

Ray 2.60 keeps its processes on loopback only in its single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
inherited by the GCS, the raylets and their workers; see apps.launch._ray_single_machine); otherwise it replaces a
loopback node address by this machine's external one and listens on every interface. But in that mode `ray start
--address` refuses to start a worker node ("Multi-node Ray clusters are not supported on Windows and OSX"). Here
the mode stays on for the processes Ray starts while this CLI process lets a worker node start, and a loopback
`--node-ip-address` / `--address` is kept as given (Ray's `services.resolve_ip_for_localhost` would put the external
address in its place). Both are private parts of ray 2.60.
"""

from __future__ import annotations

import os
import sys

SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_loopback() -> None:
    """Single-machine mode for the processes Ray starts; worker nodes allowed and loopback kept in this one."""
    os.environ[SINGLE_MACHINE_ENV] = "0"
    from ray._private import ray_constants, services

    ray_constants.ENABLE_RAY_CLUSTER = True  # read by `ray start --address` only: it would refuse a worker node
    resolve = services.resolve_ip_for_localhost

    def resolve_keeping_loopback(host: str) -> str:
        return host if services.is_localhost(host) else resolve(host)

    services.resolve_ip_for_localhost = resolve_keeping_loopback


def main() -> int:
    keep_loopback()
    from ray.scripts.scripts import main as ray_main

    return ray_main()


if __name__ == "__main__":
    sys.exit(main())
