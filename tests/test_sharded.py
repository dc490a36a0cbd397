"""GPUs done right, tested on CPU: FSDP2 through `prepare_model(parallel_strategy="fsdp2")` on
gloo, and the torch.distributed.checkpoint recipe: every rank saves its shard through `report()`, a
restore after a failure reads them back bit-exactly and training goes on as if uninterrupted.
Which device each rank takes is in `tests/unit/test_sharded.py`.
"""

from __future__ import annotations

import os

import ft_train
from tests.helpers import fault
from tests.loops import fsdp_dcp

# -- FSDP and sharded checkpoints (DCP) on gloo --------------------------------------------------


def test_fsdp_shards_checkpointed_with_dcp_restore_bit_exactly(prefect_api, tmp_path):
    from flows.train import train

    def run(name, faults=(), max_failures=0):
        return train(
            train_loop=fsdp_dcp,
            train_loop_config={"steps": 8, "every": 3, "faults": list(faults)},
            scaling_config=ft_train.ScalingConfig(num_workers=2),
            run_config=ft_train.RunConfig(
                name=name,
                storage_path=str(tmp_path / "runs"),
                failure_config=ft_train.FailureConfig(max_failures=max_failures),
            ),
        )

    whole = run("whole")
    resumed = run("resumed", [fault(tmp_path, 1, 4)], max_failures=1)
    assert whole.status == resumed.status == "finished", (whole.error, resumed.error)
    assert [f.kind for f in resumed.failures] == ["exception"]
    assert resumed.last_metrics["restored_exact"] is True  # each rank's shards, bit for bit
    assert (
        resumed.last_metrics["params"] == whole.last_metrics["params"]
    )  # and it trains on the same
    files = sorted(os.listdir(resumed.checkpoint.path))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files), files
