"""Every private name of another library that ft-train uses, checked on the versions installed:
an upgrade that removes one fails here, naming it, rather than in a run (where each adapter falls
back to slower but correct behaviour, or fails). The adapters: `ft_train/compat/forkserver.py`
(CPython), `ft_train/compat/dask_broker.py` (distributed), `ft_train/compat/torch_distributed.py`
(torch), `flows/prefect_private.py` (Prefect)."""

import importlib.util
import inspect
import multiprocessing.forkserver
import tomllib
from pathlib import Path

import distributed
import distributed.broker

import flows.prefect_private
from ft_train.compat import dask_broker, forkserver, torch_distributed

ROOT = Path(__file__).resolve().parents[2]


def test_cpython_fork_server_private_names():
    server = multiprocessing.forkserver._forkserver
    for owner, name in forkserver.PRIVATE_NAMES:
        obj = multiprocessing.forkserver if owner == "multiprocessing.forkserver" else server
        assert hasattr(obj, name), (
            f"CPython no longer has {owner}.{name} (ft_train/compat/forkserver.py)"
        )
    assert isinstance(forkserver.preload_modules(), list)


def test_torch_distributed_private_names():
    import torch
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # no process group needed to build one
    owners = {
        "torch.distributed.distributed_c10d": dist.distributed_c10d,
        "torch.distributed.ProcessGroup": dist.ProcessGroup,
        "torch.distributed.ProcessGroupGloo": dist.ProcessGroupGloo,
        "torch.distributed.ProcessGroupGloo._Options instance": options,
        "torch": torch,
    }
    for owner, name in torch_distributed.PRIVATE_NAMES:
        if owner == "torch":
            found = importlib.util.find_spec(f"torch.{name}") is not None
        else:
            found = hasattr(owners[owner], name)
        assert found, f"torch no longer has {owner}.{name} (ft_train/compat/torch_distributed.py)"


def test_distributed_broker_private_names():
    # instance attributes: read where distributed sets them, without starting a scheduler
    sets = {
        "distributed.Scheduler instance": inspect.getsource(distributed.Scheduler.__init__),
        "distributed.broker.Broker instance": inspect.getsource(distributed.broker.Broker.__init__),
        "distributed.broker.Topic instance": inspect.getsource(distributed.broker.Topic.__init__),
    }
    for owner, name in dask_broker.PRIVATE_NAMES:
        assert f"self.{name} =" in sets[owner], (
            f"distributed no longer sets {owner}.{name} (ft_train/compat/dask_broker.py)"
        )


def test_prefect_private_names():
    # read, not imported: importing Prefect's server takes many seconds, too long for this lane
    module, _, attr = flows.prefect_private.SERVER_APP.partition(":")
    source = Path(importlib.util.find_spec(module).origin).read_text()
    assert f"def {attr}(" in source, f"Prefect no longer has {flows.prefect_private.SERVER_APP}"
    for name in flows.prefect_private.EPHEMERAL_SERVER_ENV:
        assert f'"{name}"' in source, (
            f"Prefect's {module} no longer reads {name} (flows/prefect_private.py)"
        )


def test_each_library_with_a_private_api_is_bounded_above():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {d.split(">")[0].split("<")[0].strip(): d for d in project["dependencies"]}
    for library in ("prefect", "distributed"):
        assert "<" in bounds[library], (
            f"pyproject.toml: bound {library} above (its private API is used)"
        )
    assert "<" in project["requires-python"], (
        "pyproject.toml: bound requires-python above (forkserver)"
    )
