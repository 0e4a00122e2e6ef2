"""Where the coordinator runs, and the client trainer rank 0 calls it through.

    coord = start_coordinator(cfg, server_urls)   # torchrun: a subprocess; Ray: a named actor
    coord.setup(); coord.start()
    data = coord.take_step(step, dp_size)         # StepData: one shard per DP rank + the step's metrics
    coord.set_version(v); coord.checkpoint_state(next_step); coord.restore(...); coord.fail(e)
    coord.registry.begin_sync(url)                # the registry's own calls (the per-server syncer, the loop)
    coord.close()                                 # stop the producer, end the process / actor

What a client may call is `service.REMOTE_CALLS`, nothing else. The coordinator's side is one
`CoordinatorHost`: it holds the served objects (the service, its registry) and answers
`call(target, name, args, kwargs)` for a declared call only. The client's side is one `RemoteProxy`
per served object: its declared calls as methods, any other name an AttributeError naming it. A
transport is one function, `send(target, name, args, kwargs) -> bytes`, that runs the host's `call`
where the host lives. A result travels as plain pickle. An exception a call raises reaches the caller
as the same type with the same message, the coordinator's traceback added as a note; one that cannot
cross (it does not pickle) arrives as a `RemoteError` (a RuntimeError carrying its type's name, its
message and its traceback text), and so does an exception argument (`fail`) that cannot.

torchrun: a fresh Python process (it shares nothing with the trainer's torch state) running a
`multiprocessing` manager server of one `CoordinatorHost` over a Unix socket; each calling thread of
rank 0 gets its own connection, so the syncer's threads and the training loop never wait on each
other's calls. The process watches its parent and exits when trainer rank 0 is gone (a SIGKILLed run
leaves no coordinator generating behind it).
Ray: a named, threaded actor (`max_concurrency`) of one `CoordinatorHost`, found by name with `ray.get_actor`.
"""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable
from multiprocessing.managers import BaseManager

from megatron_dapo.coordinator.service import REMOTE_CALLS, CoordinatorService
from megatron_dapo.errors import CoordinatorGone, RemoteError
from megatron_dapo.runtime.lifetime import exit_with_parent

log = logging.getLogger(__name__)

Send = Callable[[str, str, tuple, dict], bytes]  # (target, name, args, kwargs) -> the host's pickled answer


def declared(target: str, name: str) -> str:
    """`name`, if it is a remote call of served object `target`; else an AttributeError naming it."""
    if name not in REMOTE_CALLS.get(target, ()):
        raise AttributeError(f"the coordinator's {target} has no remote call {name!r}", name=name)
    return name


def portable(error: BaseException) -> BaseException:
    """A copy of `error` through a pickle round trip (what the other side will get), or a RemoteError
    of its type name, message and traceback when it does not survive one (or comes back as another type)."""
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:
        return RemoteError.of(error)
    return copy if type(copy) is type(error) else RemoteError.of(error)


def _portable_arg(value):
    return portable(value) if isinstance(value, BaseException) else value


def coordinator_objects(cfg, server_urls: list[str]) -> dict:
    """What the coordinator serves, by the names of REMOTE_CALLS: the service and its registry."""
    service = CoordinatorService(cfg, server_urls)
    return {"coordinator": service, "registry": service.registry}


class CoordinatorHost:
    """The served side, under either transport: the objects `objects(*args)` builds (here, in the
    coordinator's process or actor), each answering its declared calls."""

    def __init__(self, objects: Callable[..., dict], *args):
        self._objects = objects(*args)

    def call(self, target: str, name: str, args: tuple, kwargs: dict) -> bytes:
        """Pickled (True, the call's result) or (False, the exception it raised)."""
        try:
            declared(target, name)
            method = getattr(self._objects[target], name)
            return pickle.dumps((True, method(*args, **kwargs)))
        except Exception as e:
            error = portable(e)  # a copy: an exception raised again (a stored failure) gains no second note
            error.add_note("coordinator traceback:\n" + traceback.format_exc().rstrip())
            return pickle.dumps((False, error))


class RemoteProxy:
    """Served object `target` on the client's side: each of its declared calls (REMOTE_CALLS[target])
    a method that sends it with `send` and returns its result or raises its exception."""

    def __init__(self, send: Send, target: str):
        self._send, self._target = send, target

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never a remote call (and copy / pickle probe these before __init__ ran)
            raise AttributeError(name)
        declared(self._target, name)
        send, target = self._send, self._target

        def call(*args, **kwargs):
            args = tuple(_portable_arg(a) for a in args)
            kwargs = {k: _portable_arg(v) for k, v in kwargs.items()}
            ok, value = pickle.loads(send(target, name, args, kwargs))
            if not ok:
                raise value
            return value

        call.__name__ = call.__qualname__ = name
        setattr(self, name, call)  # found without __getattr__ from now on
        return call

    def __dir__(self):
        return [*super().__dir__(), *REMOTE_CALLS[self._target]]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of the coordinator's {self._target}>"


class CoordinatorClient(RemoteProxy):
    """The coordinator as rank 0 calls it: its declared calls, `registry` (the registry's),
    `where` (where it runs, for the log) and `close`."""

    def __init__(self, send: Send, close: Callable[[], None] | None, where: str):
        super().__init__(send, "coordinator")
        self.registry = RemoteProxy(send, "registry")
        self.where, self._close = where, close

    def close(self) -> None:
        """Stop the producer and end the process (or actor); safe to call twice."""
        if self._close is None:
            return
        try:
            self.stop()
        except Exception as e:  # the process may already be gone: ending it below is what matters
            log.warning("coordinator stop: %r", e)
        finally:
            close, self._close = self._close, None
            close()


class _CoordinatorManager(BaseManager):
    pass


_CoordinatorManager.register("Coordinator", CoordinatorHost, exposed=("call",))


def start_process_coordinator(
    cfg, server_urls: list[str], start_timeout_s: float = 120.0, objects: Callable[..., dict] = coordinator_objects
) -> CoordinatorClient:
    """The coordinator in a subprocess of this process (trainer rank 0 under torchrun); `objects(cfg,
    server_urls)` builds what it serves there.

    A fresh interpreter (`python -m megatron_dapo.coordinator.process`), not a multiprocessing spawn:
    it never re-imports the trainer's main script, so no `__main__` guard is needed there. It gets an
    auth key on stdin, serves on a Unix socket and prints the socket's address."""
    key = os.urandom(32)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's imports
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_dapo.coordinator.process",
            str(os.getpid()),
            str(logging.getLogger().getEffectiveLevel()),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )

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
        host = manager.Coordinator(objects, cfg, list(server_urls))
    except BaseException:
        end()
        raise

    where = f"process {proc.pid}"

    def send(*request) -> bytes:
        try:
            return host.call(*request)  # the manager proxy's call (this thread's own connection)
        except (EOFError, OSError) as e:  # the call itself never raises these: its answer carries them
            raise CoordinatorGone(f"the rollout coordinator ({where}) is gone: {type(e).__name__}: {e}") from e

    log.info("rollout coordinator: %s", where)
    return CoordinatorClient(send, end, where)


def _read_address(proc, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise TimeoutError(f"the coordinator process did not start within {timeout_s}s")
    line = proc.stdout.readline().strip()
    if not line.startswith("ADDRESS "):
        raise RuntimeError(f"the coordinator process failed to start (exit code {proc.wait()}); see its log above")
    return line[len("ADDRESS ") :]


def serve(parent_pid: int, log_level: int) -> None:
    """The coordinator process: serve `CoordinatorHost` objects until killed or orphaned."""
    exit_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s coordinator %(name)s %(levelname)s %(message)s")
    key = bytes.fromhex(sys.stdin.readline().strip())
    server = _CoordinatorManager(address=None, authkey=key).get_server()  # a Unix socket of its own
    print(f"ADDRESS {server.address}", flush=True)
    os.dup2(2, 1)  # stdout was only for the address (the parent reads it no more): the rest goes to stderr
    server.serve_forever()


def start_ray_coordinator(
    cfg, server_urls: list[str], name: str | None = None, objects: Callable[..., dict] = coordinator_objects
) -> CoordinatorClient:
    """The coordinator as a named Ray actor (threaded: the syncer's calls run beside a waiting take_step);
    `objects(cfg, server_urls)` builds what it serves there."""
    import ray  # a Ray run's dependency only: torchrun ranks never import it
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = name or f"megatron_dapo_coordinator_{uuid.uuid4().hex[:8]}"
    # num_cpus=0: placed beside the run's placement group, never waiting for a CPU the group holds; on the
    # caller's (rank 0's) node: the two talk all the time, and a lost other node takes no coordinator with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = (
        ray.remote(CoordinatorHost)
        .options(name=name, max_concurrency=32, num_cpus=0, scheduling_strategy=here)
        .remote(objects, cfg, list(server_urls))
    )
    handle = ray.get_actor(name)

    def send(*request) -> bytes:
        try:
            return ray.get(handle.call.remote(*request))
        except ray.exceptions.RayActorError as e:  # died, or unreachable; the call's own errors come pickled
            raise CoordinatorGone(f"the rollout coordinator (Ray actor {name}) is gone: {e}") from e

    def close():
        ray.kill(actor)

    log.info("rollout coordinator: Ray actor %s", name)
    return CoordinatorClient(send, close, f"Ray actor {name}")


def start_coordinator(cfg, server_urls: list[str]) -> CoordinatorClient:
    """Under Ray (trainer.launcher=ray, this rank a Ray actor) a named actor; otherwise a subprocess."""
    ray = sys.modules.get("ray")  # a Ray worker has imported it; torchrun ranks need not pay the import
    if cfg.trainer.launcher == "ray" and ray is not None and ray.is_initialized():
        return start_ray_coordinator(cfg, server_urls)
    return start_process_coordinator(cfg, server_urls)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
