"""A private local Ray cluster for tests that drive Ray actors directly (not through a launcher)."""

from __future__ import annotations


def init_local_ray(ray, num_cpus: int, **kwargs) -> None:
    """ray.init on a new local cluster: never another test's (or a `ray start`) cluster, loopback only, no
    dashboard, a small object store, the actors' output kept out of the test's."""
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus,
        object_store_memory=100 << 20,
        log_to_driver=False,
        configure_logging=False,
        **kwargs,
    )
