"""The batch system's jobs behind a job-queue cluster (dask-jobqueue: SLURM, PBS, ...), as the
batch system sees them: when the run waits in vain for workers, the user needs to know which jobs
have not started and why (too few nodes, a partition's limit, a priority), not only that the
workers are missing.

Read from what dask-jobqueue keeps of its jobs (`cluster.workers`: one job per worker name, each
with its `job_id` once submitted) and, for SLURM, from `squeue`; for another batch system the
job ids alone are named."""

from __future__ import annotations

import logging
import shutil
import subprocess

from distributed import Client

logger = logging.getLogger("ft_train")


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
