"""The coordinator's remote calls, declared once (service.REMOTE_CALLS): every declared call of each
served object reaches that object through each transport's proxy (a fake in-process transport, the
multiprocessing manager, a Ray actor), an undeclared name is an AttributeError naming it, and an
exception raised in the coordinator reaches the caller with its type and message."""

import os
import pickle
from pathlib import Path

import pytest

from megatron_dapo.coordinator.process import (
    CoordinatorClient,
    CoordinatorHost,
    start_process_coordinator,
    start_ray_coordinator,
)
from megatron_dapo.coordinator.servers import ServerRegistry
from megatron_dapo.coordinator.service import COORDINATOR_CALLS, REGISTRY_CALLS, REMOTE_CALLS, CoordinatorService
from megatron_dapo.data.dataset import DatasetError
from megatron_dapo.errors import CheckpointError, RemoteError
from tests.local_ray import init_local_ray

ROOT = Path(__file__).resolve().parents[2]


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a lock")
        self.fn = lambda: None


class Echo:
    """Any call answers (target, name, args, kwargs); one whose first argument is an exception raises it,
    and one whose first argument is "unpicklable" raises an exception that cannot cross a process."""

    def __init__(self, target: str):
        self.target = target

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            if args and isinstance(args[0], BaseException):
                raise args[0]
            if args and args[0] == "unpicklable":
                raise Unpicklable()
            return self.target, name, args, kwargs

        return call


def echo_objects(cfg, server_urls):
    return {target: Echo(target) for target in REMOTE_CALLS}


def test_declared_calls_are_methods_of_the_served_objects():
    assert REMOTE_CALLS == {"coordinator": COORDINATOR_CALLS, "registry": REGISTRY_CALLS}
    assert all(callable(getattr(CoordinatorService, n, None)) for n in COORDINATOR_CALLS)
    assert all(callable(getattr(ServerRegistry, n, None)) for n in REGISTRY_CALLS)
    # the registry is served itself: the service forwards none of its calls
    assert not [n for n in (*REGISTRY_CALLS, "registry_metrics") if hasattr(CoordinatorService, n)]


def test_the_host_answers_declared_calls_only():
    host = CoordinatorHost(echo_objects, None, [])
    assert pickle.loads(host.call("registry", "metrics", (), {})) == (True, ("registry", "metrics", (), {}))
    for target, name in (("registry", "setup"), ("coordinator", "begin_sync"), ("nowhere", "setup")):
        ok, error = pickle.loads(host.call(target, name, (), {}))
        assert not ok and type(error) is AttributeError and repr(name) in str(error)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    init_local_ray(
        ray,
        num_cpus=1,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}},
    )
    yield
    ray.shutdown()


@pytest.fixture(
    params=["fake", pytest.param("manager", marks=pytest.mark.slow), pytest.param("ray", marks=pytest.mark.slow)]
)
def coord(request):
    if request.param == "fake":  # the host in this process, called directly
        host, stopped = CoordinatorHost(echo_objects, None, []), []
        client = CoordinatorClient(host.call, lambda: stopped.append(True), "here")
    elif request.param == "manager":
        client = start_process_coordinator(None, [], objects=echo_objects)
    else:
        request.getfixturevalue("ray_cluster")
        client = start_ray_coordinator(None, [], objects=echo_objects)
    try:
        yield client
    finally:
        client.close()


def test_every_declared_call_reaches_its_object(coord):
    for proxy, target in ((coord, "coordinator"), (coord.registry, "registry")):
        for name in REMOTE_CALLS[target]:
            assert getattr(proxy, name)(1, [2], key="v") == (target, name, (1, [2]), {"key": "v"})
        assert set(REMOTE_CALLS[target]) <= set(dir(proxy))


def test_an_undeclared_name_is_an_attribute_error_naming_it(coord):
    for proxy, name in (
        (coord, "registry_metrics"),
        (coord, "begin_sync"),
        (coord.registry, "setup"),
        (coord, "_service"),
    ):
        with pytest.raises(AttributeError, match=name) as e:
            getattr(proxy, name)
        assert e.value.name == name
    assert not hasattr(coord.registry, "producer")


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("/ckpt/step_000001/rollout.json does not fit this run"),
        DatasetError("sampler state is for a dataset of 9 prompts"),
        ValueError("no such server"),
        RuntimeError("http://a is already syncing"),
    ],
)
def test_a_remote_exception_arrives_with_its_type_and_message(coord, error):
    with pytest.raises(type(error)) as e:
        coord.restore(error, {}, 1)  # the echo raises the exception it is given, in the coordinator
    assert type(e.value) is type(error) and str(e.value) == str(error)
    assert any(n.startswith("coordinator traceback:") for n in e.value.__notes__)
    with pytest.raises(type(error), match=str(error)):
        coord.registry.begin_sync(error)


def test_exceptions_that_cannot_cross_arrive_as_runtime_errors(coord):
    """... a RemoteError (a RuntimeError) carrying the type's name, the message and the traceback."""
    with pytest.raises(RemoteError, match=r"coordinator\.test_remote\.Unpicklable: holds a lock") as e:
        coord.fail(Unpicklable())  # an unpicklable argument travels as a RemoteError
    assert isinstance(e.value, RuntimeError) and e.value.type_name.endswith(".Unpicklable")
    with pytest.raises(RemoteError, match=r"coordinator\.test_remote\.Unpicklable: holds a lock") as e:
        coord.validate("unpicklable")  # and so does an unpicklable exception raised there
    assert e.value.message == "holds a lock" and "raise Unpicklable()" in e.value.traceback_text


def test_close_stops_once():
    host, ended = CoordinatorHost(echo_objects, None, []), []
    calls = []
    client = CoordinatorClient(
        lambda *request: calls.append(request) or host.call(*request), lambda: ended.append(True), "here"
    )
    client.close()
    client.close()
    assert [c[:2] for c in calls] == [("coordinator", "stop")] and ended == [True]


@pytest.mark.slow
def test_a_dead_ray_coordinator_is_gone_not_a_call_error(ray_cluster):
    """Under Ray, a killed coordinator actor is CoordinatorGone (what coordinator/restart.py restarts on),
    never one of the call's own errors. (The process transport: tests/coordinator/test_restart.py.)"""
    import ray

    from megatron_dapo.errors import CoordinatorGone

    client = start_ray_coordinator(None, [], name="coordinator_to_kill", objects=echo_objects)
    try:
        assert client.registry.metrics() == ("registry", "metrics", (), {})
        ray.kill(ray.get_actor("coordinator_to_kill"))
        with pytest.raises(CoordinatorGone, match=r"the rollout coordinator \(Ray actor coordinator_to_kill\) is gone"):
            client.take_step(0, 1)
    finally:
        client.close()
