"""A process started with EXIT_WITH_PARENT_ENV (a rollout server launched by a run) ends once the process
that started it is gone, even SIGKILLed; one started without it (`megatron-dapo serve` by hand) keeps running."""

import os
import signal
import subprocess
import sys

import psutil

from megatron_dapo.runtime.lifetime import EXIT_WITH_PARENT_ENV

CHILD = "from megatron_dapo.runtime.lifetime import exit_with_parent_from_env as e; import time; e(); time.sleep(120)"
# the parent starts two children, with and without the variable, prints their pids, and waits to be killed
PARENT = f"""
import os, subprocess, sys, time
env = {{**os.environ, {EXIT_WITH_PARENT_ENV!r}: str(os.getpid())}}
with_env = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env)
without = subprocess.Popen([sys.executable, "-c", {CHILD!r}])
print(with_env.pid, without.pid, flush=True)
time.sleep(120)
"""


def test_a_launched_process_exits_with_its_parent_and_a_hand_started_one_does_not():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    with_env, without = map(int, parent.stdout.readline().split())
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        gone, _ = psutil.wait_procs([psutil.Process(with_env)], timeout=30)
        assert [p.pid for p in gone] == [with_env]
        assert psutil.Process(without).status() != psutil.STATUS_ZOMBIE
    finally:
        for pid in (with_env, without):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
