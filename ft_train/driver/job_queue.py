"""The batch system's jobs behind a job-queue cluster (dask-jobqueue: SLURM, PBS, ...), as the
batch system sees them.

- When the run waits in vain for workers, the user needs to know which jobs have not started and
  why (too few nodes, a partition's limit, a priority), not only that the workers are missing
  (`waiting_jobs`).
- A job that ended (its walltime or `--lifetime`, a `scancel`, a lost node) stays in
  dask-jobqueue's spec, so `adapt` never submits one in its place (dask-jobqueue#691): the run
  would wait for a worker that cannot come. `JobReplacer` scales such a job down and submits
  another, keeping the cluster's size.

Read from what dask-jobqueue keeps of its jobs (`cluster.workers`: one job per worker name, each
with its `job_id` once submitted) and, for SLURM, from `squeue`; for another batch system the
job ids alone are named, and a job counts as ended once its worker has been gone `grace_s`."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from typing import Any

from distributed import Client

logger = logging.getLogger("ft_train")

# squeue's states of a job that still holds, or will again hold, its allocation: a worker gone
# from such a job may come back (its nanny restarting it, a requeued job starting again).
_ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"}


def waiting_jobs(client: Client) -> str:
    """A clause naming the jobs of `client`'s cluster that have no worker in the scheduler yet,
    with the batch system's state and reason for each where it can tell (SLURM); "" when the
    cluster is not a job-queue cluster or every job has its worker."""
    jobs = getattr(getattr(client, "cluster", None), "workers", None)
    if not isinstance(jobs, dict):
        return ""
    joined = {str(w.get("name")) for w in client.scheduler_info(n_workers=-1)["workers"].values()}
    ids = [
        str(job.job_id)
        for name, job in jobs.items()
        if str(name) not in joined and getattr(job, "job_id", None)
    ]
    if not ids:
        return ""
    command = getattr(type(next(iter(jobs.values()))), "submit_command", "")
    if command == "sbatch" and shutil.which("squeue"):
        return f"; jobs without a worker yet, as squeue says: {_squeue(ids)}"
    return f"; jobs without a worker yet: {', '.join(ids)} (ask the batch system why)"


def _squeue(ids: list[str]) -> str:
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T %r"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("ft-train: squeue failed: %s", e)
        return ", ".join(ids)
    found = [line.split(maxsplit=2) for line in out.splitlines() if line.strip()]
    described = [f"{i} {state.lower()} ({reason})" for i, state, reason in found]
    return ", ".join(described) or ", ".join(ids)


def _squeue_states(ids: list[str]) -> dict[str, str] | None:
    """Job id -> SLURM state, for the jobs squeue still knows; None if squeue cannot be asked."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i %T"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("ft-train: squeue failed: %s", e)
        return None
    return dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())


def is_job_queue(cluster: Any) -> bool:
    """A dask-jobqueue cluster (its `job_cls` submits one batch job per worker spec entry)."""
    return getattr(cluster, "job_cls", None) is not None and hasattr(cluster, "worker_spec")


class JobReplacer:
    """Replaces the jobs of a job-queue cluster that ended after their worker had joined, every
    `every_s`, on a thread of its own while the run's cluster is open (`start`, `stop`).

    A job counts as ended when its worker has left the scheduler and the batch system no longer
    runs it: for SLURM, squeue shows it in an end state or not at all; elsewhere, its worker has
    been gone `grace_s` (a worker whose nanny restarts it comes back well within that). Such a
    job is scaled down and the cluster scaled back to its size, on the cluster's event loop, so
    that a new job is submitted (under `adapt` as without it)."""

    def __init__(self, cluster: Any, every_s: float = 2.0, grace_s: float = 60.0):
        self.cluster, self.every_s, self.grace_s = cluster, every_s, grace_s
        self.joined: set[str] = set()  # jobs whose worker was seen in the scheduler
        self.gone_since: dict[str, float] = {}
        self.replaced: list[str] = []  # job names, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ft-train-job-replacer", daemon=True)

    def start(self) -> JobReplacer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if ended := self.ended_jobs():
                    self.replace(ended)
            except Exception as e:  # the cluster closing under us, squeue gone: try again
                logger.debug("ft-train: job replacement skipped: %s", e)

    def ended_jobs(self) -> list[str]:
        """The names of the cluster's jobs that ended after their worker had joined."""
        workers = self.cluster.scheduler_info.get("workers", {}).values()
        present = {str(w.get("name")) for w in workers}
        jobs = dict(self.cluster.workers)  # name -> dask-jobqueue Job
        missing = []
        for name in map(str, jobs):
            if any(w == name or w.startswith(f"{name}-") for w in present):  # "-N": a group
                self.joined.add(name)
                self.gone_since.pop(name, None)
            elif name in self.joined:
                missing.append(name)
        if not missing:
            return []
        now = time.monotonic()
        for name in missing:
            self.gone_since.setdefault(name, now)
        ids = {name: str(getattr(jobs.get(name), "job_id", None) or "") for name in missing}
        states = None
        if (
            shutil.which("squeue")
            and getattr(self.cluster.job_cls, "submit_command", "") == "sbatch"
        ):
            states = _squeue_states([i for i in ids.values() if i])
        if states is None:  # another batch system: gone long enough
            return [n for n in missing if now - self.gone_since[n] >= self.grace_s]
        return [n for n in missing if states.get(ids[n], "").split("+")[0] not in _ALIVE]

    def replace(self, names: list[str]) -> None:
        cluster = self.cluster

        async def resubmit() -> None:
            size = len(cluster.worker_spec)
            await cluster.scale_down(names)
            cluster.scale(size)

        cluster.sync(resubmit)
        for name in names:
            self.joined.discard(name)
            self.gone_since.pop(name, None)
        self.replaced += names
        logger.info(
            "ft-train: job(s) %s ended after their worker had joined; submitted as many in "
            "their place",
            ", ".join(names),
        )
