"""Errors shared across layers (a leaf module: it imports nothing of the package).

Every exception class of the package must survive a pickle round trip with its type and message
(the coordinator carries them between processes; tests/test_errors_pickle.py checks each one): a
class whose `__init__` takes other arguments than its message defines `__reduce__`.
"""

import traceback


class CheckpointError(RuntimeError):
    """A run checkpoint (or its rollout state) is missing, incomplete or does not fit this run; the
    message names the file."""


class RemoteError(RuntimeError):
    """An exception that cannot cross a process boundary (it does not pickle), carried as what can:
    its type's qualified name, its message and its traceback text."""

    def __init__(self, type_name: str, message: str, traceback_text: str = ""):
        self.type_name, self.message, self.traceback_text = type_name, message, traceback_text
        super().__init__(f"{type_name}: {message}")

    def __reduce__(self):
        return type(self), (self.type_name, self.message, self.traceback_text), self.__dict__

    @classmethod
    def of(cls, error: BaseException) -> "RemoteError":
        t = type(error)
        text = "".join(traceback.format_exception(error)) if error.__traceback__ is not None else ""
        return cls(f"{t.__module__}.{t.__qualname__}", str(error), text)


class CoordinatorGone(RuntimeError):
    """The rollout coordinator's process (or Ray actor) no longer answers: its connection closed or the
    actor died. Raised by the transport, never by a call the coordinator ran; what a restart acts on."""


class CoordinatorLost(RuntimeError):
    """The rollout coordinator died and was not brought back within the run's restart budget; the message
    names what died and the checkpoint the run can resume from."""


class EngineOffloadedError(RuntimeError):
    """A training engine call needs state that is offloaded to host memory (colocated placement); the
    message names the call and the parts to reload."""
