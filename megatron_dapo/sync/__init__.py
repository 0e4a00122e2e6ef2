"""Weight transports trainer -> rollout servers (transport.py: the interface; broadcast.py, ipc.py, per_server.py)."""

from megatron_dapo.sync.broadcast import BroadcastTransport
from megatron_dapo.sync.errors import ServersLost, WeightSyncError
from megatron_dapo.sync.ipc import IpcTransport
from megatron_dapo.sync.transport import SyncStats, WeightTransport

__all__ = ["BroadcastTransport", "IpcTransport", "ServersLost", "SyncStats", "WeightSyncError", "WeightTransport"]
