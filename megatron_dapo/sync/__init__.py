"""Weight sync trainer -> rollout servers over a torch.distributed group (see bridge.py)."""

from megatron_dapo.sync.bridge import SyncStats, WeightSyncBridge, WeightSyncError

__all__ = ["WeightSyncBridge", "SyncStats", "WeightSyncError"]
