"""Small training functions used by the tests (importable by Dask worker processes)."""

import os

import ft_train


def report_many(config):
    """Metrics-only reports, as fast as a loop can make them."""
    for i in range(config.get("n", 100)):
        ft_train.report({"i": i})


def unequal_reports(config):
    """Breaks the report() contract: rank 1 reports once more than rank 0."""
    for i in range(3 + ft_train.get_context().get_world_rank()):
        ft_train.report({"i": i})


def gpu_probe(config):
    """Fails unless this rank uses its worker's own GPU, the first in its CUDA_VISIBLE_DEVICES
    (the only one of a SpecCluster worker; dask-cuda's LocalCUDACluster rotates the list), with
    NCCL."""
    import torch
    import torch.distributed as dist

    ctx = ft_train.get_context()
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    model = ft_train.torch.prepare_model(torch.nn.Linear(4, 2))
    device = next(model.parameters()).device
    assert cvd is not None, "CUDA_VISIBLE_DEVICES is not set"
    assert torch.cuda.device_count() == len(cvd.split(",")), (cvd, torch.cuda.device_count())
    assert device.index == 0, device  # the worker's own: listed first
    assert dist.get_backend() == "nccl", dist.get_backend()
    assert device.type == "cuda", device
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    assert t.item() == ctx.get_world_size()
    own = cvd.split(",")[0]
    ft_train.report({"cvd": own, "device": str(device), "world": ctx.get_world_size()})


def fast_checkpoints(config):
    """Data-parallel training at a few ms a step that resumes bit-exactly: a tiny model, each
    step's batch drawn from the step number, a checkpoint every `every` steps from rank 0 only
    (the other ranks attach none, as in Ray's guide) or from every rank (`sharded`), uploaded
    with `mode` ("sync" or "async"). Faults from `faults` (ft_train.testing.faults) at the top of a step:
    at step s, right after report s returned. `snapshot`: offer report() the same state as an
    in-memory snapshot at every report (ft-train takes it every `snapshot_every`), as
    {file: state}, or as a function save(directory) with "save"; `jit`: opt in
    to a just-in-time save (every rank saves the whole replica as rank0.pt; "files": as
    {file: state}, else with save(directory)); `step_s`: seconds
    of simulated compute a step; `final_checkpoint` (default True): False, and the last report
    carries no checkpoint unless `every` divides it; `log`: a file where rank 0 writes a line
    "report resumed_from epoch-seconds" as each report() returns (what the run did, as a test
    reads it)."""
    import tempfile
    import time

    import torch

    from ft_train.testing.faults import maybe_inject

    ctx = ft_train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    steps, every = config["steps"], config.get("every", 4)
    sharded, mode = config.get("sharded", False), config.get("mode", "sync")
    torch.manual_seed(0)
    model = ft_train.torch.prepare_model(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raw, step = getattr(model, "module", model), 0
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, f"rank{rank if sharded else 0}.pt"))
        raw.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    resumed_from = step

    def state() -> dict:
        return {"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "step": step}

    def save_snapshot(d: str) -> None:
        if sharded or rank == 0:
            torch.save(state(), os.path.join(d, f"rank{rank}.pt"))

    def snapshot() -> object:
        if config.get("snapshot") == "save":
            return save_snapshot
        if config.get("snapshot"):
            return {f"rank{rank}.pt": state()} if sharded or rank == 0 else {}
        return None

    if config.get("jit") == "files":
        ft_train.enable_jit_checkpoint(files=lambda: {"rank0.pt": state()})
    elif config.get("jit"):
        ft_train.enable_jit_checkpoint(lambda d: torch.save(state(), os.path.join(d, "rank0.pt")))
    while step < steps:
        maybe_inject(config.get("faults"), rank, step)
        if config.get("step_s"):
            time.sleep(config["step_s"])  # the step's compute, not a synchronisation
        batch = torch.Generator().manual_seed(step * world + rank)
        x, y = torch.randn(16, 8, generator=batch), torch.randn(16, 4, generator=batch)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        metrics = {"step": step, "loss": loss.item(), "resumed_from": resumed_from}
        if step % every and (step < steps or not config.get("final_checkpoint", True)):
            ft_train.report(metrics, snapshot=snapshot())
            _log_report(config, rank, step, resumed_from)
            continue
        with tempfile.TemporaryDirectory() as d:
            if sharded or rank == 0:
                torch.save(state(), os.path.join(d, f"rank{rank}.pt"))
                attached = ft_train.Checkpoint.from_directory(d)
            else:
                attached = None
            ft_train.report(
                metrics, checkpoint=attached, checkpoint_upload_mode=mode, snapshot=snapshot()
            )
        _log_report(config, rank, step, resumed_from)


def _log_report(config, rank: int, step: int, resumed_from: int) -> None:
    """`fast_checkpoints`' `log`: one line, one write (a kill leaves whole lines)."""
    if config.get("log") and rank == 0:
        import time

        fd = os.open(config["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{step} {resumed_from} {time.time():.6f}\n".encode())
        finally:
            os.close(fd)


def two_args(config, extra):
    """A training function a rank cannot call: two required parameters."""


def report_counts(config):
    """Breaks the report() contract: rank r reports config["counts"][r] times."""
    for i in range(config["counts"][ft_train.get_context().get_world_rank()]):
        ft_train.report({"i": i})


def bad_report(config):
    """One report() that breaks its contract as config["case"] says; a function that a rank
    would run again on a retry, and fail again."""
    import tempfile

    d = tempfile.mkdtemp(prefix="bad-report-")
    case = config["case"]
    if case == "not_json":
        ft_train.report({"model": object()})
    elif case == "missing_dir":
        ft_train.report({"i": 0}, checkpoint=ft_train.Checkpoint.from_directory(d + "/never-saved"))
    elif case == "empty_dir":
        ft_train.report({"i": 0}, checkpoint=ft_train.Checkpoint.from_directory(d))


def non_finite_metrics(config):
    """A diverged loss: NaN and infinities at any depth of the metrics, with a checkpoint."""
    import tempfile

    d = tempfile.mkdtemp(prefix="nan-")
    with open(os.path.join(d, "weights.txt"), "w") as f:
        f.write("diverged")
    nan, inf = float("nan"), float("inf")
    metrics = {"loss": nan, "grad_norm": inf, "per_class": [0.5, -inf], "nested": {"x": nan}}
    ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(d))


def kill_driver(config):
    """A training function whose driver always dies: rank 0 reports once, then SIGKILLs the
    driver (the flow process named in the run's lease on the local `storage_path`), as the OOM
    killer would, and waits to go with it."""
    import signal
    import threading

    from ft_train.driver.lease import read_lease
    from ft_train.storage.fs import Storage

    ft_train.report({"step": 1})
    if ft_train.get_context().get_world_rank() == 0:
        lease = read_lease(
            Storage(config["storage_path"]), ft_train.get_context().get_experiment_name()
        )
        os.kill(lease.pid, signal.SIGKILL)
    threading.Event().wait(60)  # the driver's processes go with it; never report again
    os._exit(1)


def fsdp_dcp(config):
    """An FSDP2 model trained with AdamW, each step's batch drawn from the step number; every
    `every` steps each rank saves its shard with `save_sharded` into its own directory and
    attaches it, with its local shards as plain tensors (`expect-{rank}.pt`) to compare with.
    A restore loads the checkpoint into a model initialised differently and reports whether the
    shards it got equal the saved ones, bit for bit."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ft_train.testing.faults import maybe_inject

    rank = ft_train.get_context().get_world_rank()
    torch.manual_seed(1 if ft_train.get_checkpoint() else 0)  # a restore must not rely on it
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = ft_train.torch.prepare_model(net, parallel_strategy="fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    step, exact = 0, None
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        with checkpoint.as_directory() as d:
            ft_train.torch.load_sharded(state, d)
            expect = torch.load(os.path.join(d, f"expect-{rank}.pt"))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        step = int(state["step"])
        exact = local_shards(get_state_dict(model, optimizer)) == {
            k: v.tolist() for k, v in expect.items()
        }
    while step < config["steps"]:
        maybe_inject(config.get("faults"), rank, step)
        batch = torch.Generator().manual_seed(step * 2 + rank)
        x, y = torch.randn(16, 8, generator=batch), torch.randn(16, 4, generator=batch)
        device = ft_train.torch.get_device()  # cuda on a GPU run (tests/test_gpu.py)
        loss = ((model(x.to(device)) - y.to(device)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        metrics = {"step": step, "restored_exact": exact, "params": params(model)}
        if step % config["every"]:
            ft_train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:
            msd, osd = get_state_dict(model, optimizer)
            ft_train.torch.save_sharded({"model": msd, "optim": osd, "step": torch.tensor(step)}, d)
            shards = {k: torch.tensor(v) for k, v in local_shards((msd, osd)).items()}
            torch.save(shards, os.path.join(d, f"expect-{rank}.pt"))
            ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(d))


def local_shards(state_dicts) -> dict:
    """This rank's shard of every tensor in (model, optimizer) state dicts, as lists."""
    from torch.distributed.tensor import DTensor

    out = {}
    msd, osd = state_dicts
    flat = {f"model.{k}": v for k, v in msd.items()}
    for p, s in osd["state"].items():
        flat.update({f"optim.{p}.{k}": v for k, v in s.items()})
    for k, v in flat.items():
        v = v.to_local() if isinstance(v, DTensor) else v
        out[k] = v.detach().cpu().reshape(-1).tolist() if hasattr(v, "detach") else v
    return out


def params(model) -> list:
    """The full parameters (every rank's shards), as exact float lists."""
    return [p.full_tensor().detach().reshape(-1).tolist() for p in model.parameters()]


def in_slurm_jobs(config):
    """The demo's loop, each rank first writing the SLURM job it runs in to
    `{config["jobs_dir"]}/rank-{rank}` (tests/test_slurm.py: which job to cancel for a rank)."""
    from ft_train.examples.digits import train_loop

    rank = ft_train.get_context().get_world_rank()
    path = os.path.join(config["jobs_dir"], f"rank-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(os.environ.get("SLURM_JOB_ID", ""))
    os.replace(path + ".tmp", path)
    train_loop({k: v for k, v in config.items() if k != "jobs_dir"})
