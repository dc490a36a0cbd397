"""The guide's job-driver entrypoint (`__job_driver_fault_tolerance_start__` in Ray's
`doc_code/fault_tolerance.py`), ported by renaming: the job submitter picks the run's
`(storage_path, name)` and passes them as arguments, so that the same command, run again after
the driver died, resumes the run.

    python tests/ray_entrypoint.py --storage_path PATH --run_name NAME

The training function is the guide's worker fault-tolerance example
(`tests.ray_patterns:worker_fault_tolerance`). The test's own arguments: `--storage_options`
(JSON, for the loopback S3) and `--train_loop_config` (JSON: steps, step time, faults).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import ft_train  # noqa: E402
from ft_train.torch import TorchTrainer  # noqa: E402
from tests.ray_patterns import worker_fault_tolerance  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage_path", type=str, required=True)
    parser.add_argument("--run_name", type=str, required=True)
    parser.add_argument("--storage_options", type=json.loads, default={})
    parser.add_argument("--train_loop_config", type=json.loads, default={})
    args = parser.parse_args()

    trainer = TorchTrainer(
        worker_fault_tolerance,
        train_loop_config=args.train_loop_config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            # [3] a failed rank restarts the group, up to 3 times
            failure_config=ft_train.FailureConfig(max_failures=3),
            # [4] the run's identity comes from whoever submits the job: the same arguments
            # resume the run
            storage_path=args.storage_path,
            storage_options=args.storage_options,
            name=args.run_name,
        ),
    )
    trainer.fit()
