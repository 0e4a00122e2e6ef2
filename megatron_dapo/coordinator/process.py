"""Where the coordinator runs, and the small client trainer rank 0 talks to it through.

    coord = start_coordinator(cfg, server_urls)   # torchrun: a subprocess; Ray: a named actor
    coord.setup(); coord.start()
    data = coord.take_step(step, dp_size)         # StepData: one shard per DP rank + the step's metrics
    coord.set_version(v); coord.checkpoint_state(next_step); coord.restore(...); coord.fail(e)
    coord.registry                                # the registry calls of the per-server syncer
    coord.close()                                 # stop the producer, end the process / actor

torchrun: a fresh Python process (it shares nothing with the trainer's torch state) running a
`multiprocessing` manager server of one `CoordinatorService` over a Unix socket; each calling
thread of rank 0 gets its own connection, so the syncer's threads and the training loop never wait
on each other's calls. The process watches its parent and exits when trainer rank 0 is gone (a SIGKILLed run
leaves no coordinator generating behind it).
Ray: a named, threaded actor (`max_concurrency`), found by name with `ray.get_actor`.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import uuid
from multiprocessing.managers import BaseManager

from megatron_dapo.runtime.lifetime import exit_with_parent

log = logging.getLogger(__name__)


class _CoordinatorManager(BaseManager):
    pass


def _service(cfg, urls):
    from megatron_dapo.coordinator.service import CoordinatorService

    return CoordinatorService(cfg, urls)


_CoordinatorManager.register("Coordinator", _service)


class RegistryClient:
    """The coordinator's ServerRegistry as the per-server syncer and the loop use it."""

    def __init__(self, call):
        self._call = call

    def begin_sync(self, url: str) -> None:
        self._call("begin_sync", url)

    def end_sync(self, url: str, version: int | None) -> None:
        self._call("end_sync", url, version)

    def publish_all(self, version: int, seconds: float = 0.0) -> None:
        self._call("publish_all", version, seconds)

    def statuses(self) -> list:
        return self._call("statuses")

    def metrics(self) -> dict[str, float]:
        return self._call("registry_metrics")

    def take_events(self) -> list[dict]:
        return self._call("take_events")


class CoordinatorClient:
    def __init__(self, call, close, where: str):
        self._call, self._close, self.where = call, close, where
        self.registry = RegistryClient(call)

    def setup(self) -> dict:
        return self._call("setup")

    def restore(self, found: str, state: dict, next_step: int) -> None:
        self._call("restore", found, state, next_step)

    def start(self) -> None:
        self._call("start")

    def take_step(self, step: int, dp_size: int):
        return pickle.loads(self._call("take_step", step, dp_size))

    def set_version(self, version: int) -> None:
        self._call("set_version", version)

    def fail(self, error: BaseException) -> None:
        try:
            pickle.dumps(error)
        except Exception:  # an exception that cannot cross the process boundary: its repr does
            error = RuntimeError(repr(error))
        self._call("fail", error)

    def checkpoint_state(self, next_step: int | None) -> dict:
        return self._call("checkpoint_state", next_step)

    def validate(self) -> dict | None:
        return self._call("validate")

    def close(self) -> None:
        """Stop the producer and end the process (or actor); safe to call twice."""
        if self._close is None:
            return
        try:
            self._call("stop")
        except Exception as e:  # the process may already be gone: ending it below is what matters
            log.warning("coordinator stop: %r", e)
        finally:
            close, self._close = self._close, None
            close()


def start_process_coordinator(cfg, server_urls: list[str], start_timeout_s: float = 120.0) -> CoordinatorClient:
    """The coordinator in a subprocess of this process (trainer rank 0 under torchrun).

    A fresh interpreter (`python -m megatron_dapo.coordinator.process`), not a multiprocessing spawn:
    it never re-imports the trainer's main script, so no `__main__` guard is needed there. It gets an
    auth key on stdin, serves on a Unix socket and prints the socket's address."""
    import subprocess

    key = os.urandom(32)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's imports
    proc = subprocess.Popen([sys.executable, "-m", "megatron_dapo.coordinator.process", str(os.getpid()),
                             str(logging.getLogger().getEffectiveLevel())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def end():
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    try:
        proc.stdin.write(key.hex() + "\n")
        proc.stdin.close()
        address = _read_address(proc, start_timeout_s)
        manager = _CoordinatorManager(address=address, authkey=key)
        manager.connect()
        proxy = manager.Coordinator(cfg, list(server_urls))
    except BaseException:
        end()
        raise

    def call(name, *args):
        return getattr(proxy, name)(*args)

    log.info("rollout coordinator: process %d", proc.pid)
    return CoordinatorClient(call, end, f"process {proc.pid}")


def _read_address(proc, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise TimeoutError(f"the coordinator process did not start within {timeout_s}s")
    line = proc.stdout.readline().strip()
    if not line.startswith("ADDRESS "):
        raise RuntimeError(f"the coordinator process failed to start (exit code {proc.wait()}); see its log above")
    return line[len("ADDRESS "):]


def serve(parent_pid: int, log_level: int) -> None:
    """The coordinator process: serve `CoordinatorService` objects until killed or orphaned."""
    exit_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s coordinator %(name)s %(levelname)s %(message)s")
    key = bytes.fromhex(sys.stdin.readline().strip())
    server = _CoordinatorManager(address=None, authkey=key).get_server()  # a Unix socket of its own
    print(f"ADDRESS {server.address}", flush=True)
    os.dup2(2, 1)  # stdout was only for the address (the parent reads it no more): the rest goes to stderr
    server.serve_forever()


def start_ray_coordinator(cfg, server_urls: list[str], name: str | None = None) -> CoordinatorClient:
    """The coordinator as a named Ray actor (threaded: the syncer's calls run beside a waiting take_step)."""
    import ray

    from megatron_dapo.coordinator.service import CoordinatorService

    name = name or f"megatron_dapo_coordinator_{uuid.uuid4().hex[:8]}"
    # num_cpus=0: placed beside the run's placement group, never waiting for a CPU the group holds
    actor = ray.remote(CoordinatorService).options(name=name, max_concurrency=32, num_cpus=0).remote(
        cfg, list(server_urls))
    handle = ray.get_actor(name)

    def call(method, *args):
        return ray.get(getattr(handle, method).remote(*args))

    def close():
        ray.kill(actor)

    log.info("rollout coordinator: Ray actor %s", name)
    return CoordinatorClient(call, close, f"Ray actor {name}")


def start_coordinator(cfg, server_urls: list[str]) -> CoordinatorClient:
    """Under Ray (trainer.launcher=ray, this rank a Ray actor) a named actor; otherwise a subprocess."""
    ray = sys.modules.get("ray")  # a Ray worker has imported it; torchrun ranks need not pay the import
    if cfg.trainer.launcher == "ray" and ray is not None and ray.is_initialized():
        return start_ray_coordinator(cfg, server_urls)
    return start_process_coordinator(cfg, server_urls)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
