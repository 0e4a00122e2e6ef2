"""A real two-node Slurm cluster on loopback, for the tests of the multi-node launchers.

munged (its own key and socket), slurmctld and two slurmd (`slurmd -N n1`, `slurmd -N n2`: Slurm's
multiple-slurmd mode, both nodes at 127.0.0.1 on ports of their own) run from a temporary directory with
their own slurm.conf, state and spool directories; nothing of the machine's Slurm or munge setup is read
or written. Clients reach it through `SlurmCluster.env` (SLURM_CONF). It needs root (slurmd runs jobs as
the submitting user and munged / slurmd check ownership) and Debian's `slurm-wlm` and `munge`;
`unavailable()` says why it cannot start here, and the tests skip with that reason.

Every daemon is started in the foreground as a child of the test process and killed (and waited for) at
teardown, then checked gone by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.runtime.net import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol")
NODES = ("n1", "n2")


def unavailable() -> str | None:
    """Why a test cluster cannot start here (None when it can)."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd runs jobs as their user; munged and slurmd check ownership)"
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"Slurm / munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ctld_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client (sbatch, srun, ...) talking to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def run(self, *cmd: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=self.env, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout}{out.stderr}")
        return out

    # --------------------------------------------------------------------------------------------- start

    def start(self, timeout: float = 60) -> "SlurmCluster":
        self._write_config()
        self._start_munged()
        self._spawn("slurmctld", _bin("slurmctld"), "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            (self.root / "spool" / node).mkdir(parents=True)
            self._spawn(f"slurmd-{node}", _bin("slurmd"), "-D", "-N", node, "-f", str(self.conf))
        self._wait_idle(timeout)
        return self

    def _write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir()
        self.ctld_port = free_port("127.0.0.1")
        self.node_ports = {n: free_port("127.0.0.1") for n in NODES}
        cpus = os.cpu_count() or 1
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus} State=UNKNOWN"
            for n, p in self.node_ports.items()
        )
        r = self.root
        self.conf.write_text(
            f"""ClusterName=mdapotest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmctldParameters=enable_configless
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=test Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
        )

    def _start_munged(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn(
            "munged",
            _bin("munged"),
            "--foreground",
            "--force",
            f"--socket={self.root}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={self.root}/munged.pid",
            f"--seed-file={self.root}/munged.seed",
            f"--log-file={self.root}/munged.log",
        )
        deadline = time.monotonic() + 20
        while not (self.root / "munge.socket").exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log('munged')}")
            time.sleep(0.1)

    def _spawn(self, name: str, *cmd: str) -> None:
        out = open(self.root / f"{name}.out", "w")  # noqa: SIM115 - kept open for the daemon's life
        # own session: a daemon's process group is killed whole at teardown
        self.procs[name] = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_idle(self, timeout: float) -> None:
        """Until sinfo shows both nodes idle."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}): {self._daemon_output(name)}")
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20)
            last = out.stdout + out.stderr
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm nodes did not become idle in {timeout} s: sinfo says {last!r}")

    def _daemon_output(self, name: str) -> str:
        text = (self.root / f"{name}.out").read_text(errors="replace")
        log_name = {"munged": "munged", "slurmctld": "slurmctld"}.get(name, name)
        return (text + self.log(log_name))[-3000:]

    # ------------------------------------------------------------------------------------------ teardown

    def stop(self) -> None:
        """Cancel every job, then kill each daemon's process group and wait for it; raises if one survives."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", "root", check=False, timeout=20)
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        left = [name for name, p in self.procs.items() if _alive(p.pid)]
        if left:
            raise RuntimeError(f"Slurm test daemons still running after teardown: {left}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
