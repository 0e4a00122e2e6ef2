"""Stands in for trainer rank 0: starts the coordinator process, prints its pid, waits to be killed."""

import sys
import time

from megatron_dapo.config.schema import DapoConfig
from megatron_dapo.coordinator.process import start_process_coordinator

if __name__ == "__main__":
    coord = start_process_coordinator(DapoConfig(), sys.argv[1:])
    coord.registry.begin_sync(sys.argv[1])
    print("COORDINATOR", coord.where.split()[-1], flush=True)
    time.sleep(600)
