"""A real SLURM cluster on this machine, for the tests: munge, `slurmctld`, and several `slurmd`
nodes, each a daemon of its own on a port of its own (`slurmd -N`, SLURM's way to run several
nodes on one host), one CPU each, in one partition. Jobs are real `sbatch` jobs run by those
daemons; `scancel`, a walltime and a killed `slurmd` do what they do on a cluster.

SLURM's own timeouts are short here (a node that stops answering is DOWN after `SlurmdTimeout`
10 s, a job's processes get `KillWait` 2 s between SIGTERM and SIGKILL), so that a lost node is
noticed in seconds. Everything lives under one directory: the configuration, the daemons' state,
spool and logs, and munge's key and socket; nothing of the machine's own SLURM or munge is used
or changed. The commands (`sbatch`, `squeue`, `scancel`) find the cluster through `SLURM_CONF`,
which `env()` gives and `activate()` sets in this process (dask-jobqueue calls them from here).

Needs root (the daemons run as root) and Debian's `slurm-wlm` and `munge`; `unavailable()` says
why not. `.ci/run` installs both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil

from tests.helpers import wait_for

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol")


def unavailable() -> str | None:
    """Why a SLURM cluster cannot be started here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the SLURM daemons of the test cluster run as root: run the tests as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """`nodes` SLURM nodes (`n1`, `n2`, ...) of one CPU each on this machine, in the partition
    `debug`; `close()` cancels every job and stops every daemon."""

    def __init__(self, root: Path, nodes: int = 3) -> None:
        self.root = root
        self.name = f"ft{uuid.uuid4().hex[:6]}"  # the cluster's name: its jobs carry it
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        for d in ("state", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        self._ports = _free_ports(2 + nodes)
        self._write_conf()

    def _write_conf(self) -> None:
        host = socket.gethostname()
        ctld, _, *node_ports = self._ports
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self.root}/munge/sock",
            "SlurmUser=root\nSlurmdUser=root",
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool/%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid\nSlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/log/slurmctld.log",
            f"SlurmdLogFile={self.root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none\nMpiDefault=none",
            "SchedulerType=sched/backfill\nSchedulerParameters=sched_interval=1",
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU",
            # a node back after a failure takes jobs again at once
            "ReturnToService=2",
            # short: a lost node is DOWN in seconds, a cancelled job's processes go in 2 s
            "SlurmctldTimeout=10\nSlurmdTimeout=10\nMessageTimeout=5\nKillWait=2",
            "InactiveLimit=0\nMinJobAge=30",
            "SlurmdParameters=config_overrides",  # one CPU per node, whatever the machine has
            *(
                f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=1 "
                "RealMemory=4000 State=UNKNOWN"
                for n, p in zip(self.nodes, node_ports, strict=True)
            ),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def activate(self) -> None:
        """SLURM's commands run from this process (dask-jobqueue's `sbatch`) use this cluster."""
        os.environ.update(self.env())

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        m = self.root / "munge"
        subprocess.run(["mungekey", "-c", "-f", "-k", str(m / "key")], check=True)
        self._daemon(
            "munged", "-F", "--force", f"--socket={m}/sock", f"--key-file={m}/key",
            f"--pid-file={m}/pid", f"--log-file={m}/log", f"--seed-file={m}/seed",
        )  # fmt: skip
        self._wait(lambda: (m / "sock").exists(), 10, "munged's socket")
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        for node in self.nodes:
            self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", node)
        self._wait(lambda: set(self.idle_nodes()) == set(self.nodes), timeout_s, "idle nodes")
        return self

    def _daemon(self, *cmd: str) -> None:
        log = open(self.root / "log" / f"{cmd[0]}-{len(self.procs)}.out", "w")
        env = dict(os.environ, **self.env())
        self.procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )

    def _wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"SLURM test cluster: no {what} after {timeout_s} s (exited: {dead}); "
                    f"logs under {self.root / 'log'}"
                )
            time.sleep(0.2)

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(os.environ, **self.env()), timeout=30
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
        return done.stdout

    def idle_nodes(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False)
        return out.split()

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def jobs(self) -> list[dict]:
        """Every job the controller knows (pending, running, and ended in the last MinJobAge):
        id, name, state, node, reason."""
        out = self.run("squeue", "-h", "-t", "all", "-o", "%i|%j|%T|%N|%r")
        keys = ("id", "name", "state", "node", "reason")
        return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines()]

    def running(self) -> dict[str, str]:
        """Running jobs: job id -> node."""
        return {j["id"]: j["node"] for j in self.jobs() if j["state"] == "RUNNING"}

    def scancel(self, job_id: str) -> None:
        self.run("scancel", job_id)

    def job_processes(self, job_id: str) -> list[psutil.Process]:
        """The processes of a job: its batch script and what it started (by SLURM_JOB_ID in
        their environment) and the `slurmstepd` that runs it."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or ())
                if cmd.startswith("slurmstepd:") and f"[{job_id}." in cmd:
                    found.append(p)
                elif p.environ().get("SLURM_JOB_ID") == job_id and (
                    p.environ().get("SLURM_CLUSTER_NAME") == self.name
                ):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL of a node's `slurmd` and of every process of the jobs it runs: what a machine
        that loses power does to them. The controller notices the node is gone only when it
        stops answering (SlurmdTimeout). Returns the pids killed.

        All of them stop first (SIGSTOP: from then on none runs, as at a power cut), then the
        parents die, then, once they are gone, the leaves (the Dask workers). A killed worker's
        connection closes at once, where a dead machine's goes silent: had its nanny been
        killed in the same breath, a loaded host could still run the nanny's exit after the
        scheduler saw the worker go, and the nanny would answer as if only the process died."""
        daemon = next(p for p in self.procs if p.args[0] == "slurmd" and list(p.args)[-1] == node)
        jobs = [j for j, n in self.running().items() if n == node]
        victims = [psutil.Process(daemon.pid)] + [p for j in jobs for p in self.job_processes(j)]
        for p in victims:
            _signal(p, signal.SIGSTOP)
        leaves = [p for p in victims if not set(_children(p)) & set(victims)]
        parents = [p for p in victims if p not in leaves]
        for p in parents:
            _signal(p, signal.SIGKILL)
        wait_for(lambda: all(_gone(p) for p in parents), 30, "a dead node's parent processes")
        for p in leaves:
            _signal(p, signal.SIGKILL)
        return [p.pid for p in victims]

    def restart_node(self, node: str) -> None:
        self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", node)

    def close(self) -> None:
        """Cancel every job, then stop the daemons; any job process left is killed."""
        try:
            self.run("scancel", "--full", "-M", self.name, "-u", "root", check=False)
        except Exception:  # the controller may be gone already
            pass
        left = [p for j in {j["id"] for j in self._jobs_or_none()} for p in self.job_processes(j)]
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in left + self._strays():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def _jobs_or_none(self) -> list[dict]:
        try:
            return self.jobs()
        except Exception:
            return []

    def _strays(self) -> list[psutil.Process]:
        """Any process still carrying this cluster's name (a job step whose daemon is gone)."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("SLURM_CLUSTER_NAME") == self.name:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def settle(self, timeout_s: float = 90) -> None:
        """Cancel any job left and return every node to service, then wait until all are idle."""
        self.run("scancel", "-u", "root", check=False)
        for node, state in self.node_states().items():
            if state.rstrip("*").lower() in ("down", "drained", "draining", "fail"):
                self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        self._wait(
            lambda: set(self.idle_nodes()) == set(self.nodes) and not self._active_jobs(),
            timeout_s,
            f"idle nodes and no jobs ({self.describe()})",
        )

    def _active_jobs(self) -> list[dict]:
        return [
            j for j in self._jobs_or_none() if j["state"] in ("PENDING", "RUNNING", "COMPLETING")
        ]

    def log_tail(self, lines: int = 40) -> str:
        log = self.root / "log" / "slurmctld.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""

    def pending_reasons(self) -> dict[str, str]:
        return {j["id"]: j["reason"] for j in self.jobs() if j["state"] == "PENDING"}

    def describe(self) -> str:
        """For an assertion's message: the nodes and jobs as the controller sees them."""
        return json.dumps({"nodes": self.node_states(), "jobs": self._jobs_or_none()})


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children()
    except psutil.NoSuchProcess:
        return []


def _gone(p: psutil.Process) -> bool:
    """Exited: its sockets are closed (a zombie no one reaps counts: it holds none)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
