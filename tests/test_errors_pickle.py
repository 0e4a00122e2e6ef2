"""Every exception class the package defines survives a pickle round trip with its type and message
(the coordinator carries exceptions between processes: one that does not pickle used to vanish in a
thread nobody joined). The classes are found by walking the package, so a new one is checked too;
each is built from its own signature with plausible arguments. One that cannot cross still arrives
as a RemoteError carrying its type name, message and traceback."""

import importlib
import inspect
import pickle
import pkgutil

import pytest

import megatron_dapo
from megatron_dapo.coordinator.process import CoordinatorHost, portable
from megatron_dapo.errors import RemoteError

# optional runtimes a module may need; without one installed its module cannot be imported here
OPTIONAL = ("ray", "triton", "wandb", "math_verify")


def _modules():
    for info in pkgutil.walk_packages(megatron_dapo.__path__, "megatron_dapo."):
        if info.name.endswith("__main__"):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError as e:
            if e.name is None or e.name.split(".")[0] not in OPTIONAL:
                raise


def _exception_classes() -> list[type]:
    found = {}
    for mod in _modules():
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("megatron_dapo."):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


CLASSES = _exception_classes()

SAMPLES = {int: 503, float: 2.5, str: "the message", bool: True}


def _value(param: inspect.Parameter, i: int):
    ann = param.annotation
    if (isinstance(ann, str) and ann.startswith("dict")) or ann is dict or getattr(ann, "__origin__", None) is dict:
        return {f"{param.name} {i}": "a value"}
    if isinstance(ann, str):  # from __future__ import annotations: the annotation's text
        for t, v in SAMPLES.items():
            if ann.split("|")[0].strip() == t.__name__:
                return v if t is not str else f"{param.name} {i}"
    elif ann in SAMPLES:
        return SAMPLES[ann] if ann is not str else f"{param.name} {i}"
    return f"{param.name} {i}"


def _instance(cls: type) -> BaseException:
    """`cls` built with a value for each of its parameters (defaults too: a default of None would hide one)."""
    sig = inspect.signature(cls.__init__)
    args, kwargs = [], {}
    for i, p in enumerate(list(sig.parameters.values())[1:]):
        if p.kind is p.VAR_POSITIONAL:
            args.append(f"message of {cls.__name__}")
        elif p.kind is p.VAR_KEYWORD:
            continue
        elif p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = _value(p, i)
        else:
            args.append(_value(p, i))
    return cls(*args, **kwargs)


def test_the_walk_finds_the_package_exceptions():
    names = {c.__name__ for c in CLASSES}
    # known ones from several rooms: proof that the walk reached them
    assert {"SGLangConnectionError", "SGLangHTTPError", "ConfigError", "DynamicSamplingExhausted"} <= names
    assert {"WeightSyncError", "NoHealthyServer", "RemoteError", "DatasetError"} <= names
    assert len(CLASSES) >= 20


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_exception_class_round_trips_through_pickle(cls):
    error = _instance(cls)
    error.add_note("a note travels too")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error) and back.args == error.args
    assert back.__notes__ == ["a note travels too"]
    assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(error).items()}


def test_sglang_errors_keep_their_fields():
    from megatron_dapo.rollout.client import SGLangConnectionError, SGLangHTTPError

    for error in (SGLangConnectionError("/pause_generation", "connection refused"), SGLangHTTPError("/x", "bad", 400)):
        back = portable(error)
        assert type(back) is type(error) and str(back) == str(error)
        assert (back.endpoint, back.server_message, back.status) == (error.endpoint, error.server_message, error.status)


class HoldsALambda(RuntimeError):
    def __init__(self, message):
        super().__init__(message)
        self.callback = lambda: None  # does not pickle


class ComesBackAsAnother(Exception):
    def __reduce__(self):
        return ValueError, self.args


def _raised(error):
    try:
        raise error
    except BaseException as e:
        return e


def test_an_exception_that_cannot_cross_arrives_as_a_remote_error_with_type_message_and_traceback():
    error = _raised(HoldsALambda("stuck on server 1"))
    carried = pickle.loads(pickle.dumps(portable(error)))
    assert type(carried) is RemoteError and isinstance(carried, RuntimeError)
    assert carried.type_name == f"{__name__}.HoldsALambda" and carried.message == "stuck on server 1"
    assert "HoldsALambda: stuck on server 1" in carried.traceback_text and "_raised" in carried.traceback_text
    assert str(carried) == f"{__name__}.HoldsALambda: stuck on server 1"
    # one whose pickle gives back another type is carried as well, not turned into that type
    other = portable(ComesBackAsAnother("x"))
    assert type(other) is RemoteError and other.type_name.endswith("ComesBackAsAnother")


def test_the_host_sends_an_unpicklable_failure_as_a_remote_error():
    class Raises:
        def fail(self, error):
            raise HoldsALambda("from the coordinator")

    host = CoordinatorHost(lambda: {"coordinator": Raises()})
    ok, error = pickle.loads(host.call("coordinator", "fail", (None,), {}))
    assert not ok and type(error) is RemoteError and error.message == "from the coordinator"
    assert "in fail" in error.traceback_text
    assert any(n.startswith("coordinator traceback:") for n in error.__notes__)
