"""Ray Train's `ray.train.huggingface.transformers`, renamed: `RayTrainReportCallback` (with
`CHECKPOINT_NAME`, the folder of a reported checkpoint that holds the Trainer's files) and
`prepare_trainer`, the very objects of `ft_train.integrations.transformers` under Ray's names,
so that code written to Ray's Transformers guide runs with `ray.train` renamed `ft_train`.

Importing this module imports transformers (`pip install "ft-train[transformers]"`).
"""

from ft_train.integrations.transformers import ReportCallback as RayTrainReportCallback
from ft_train.integrations.transformers import prepare_trainer

__all__ = ["RayTrainReportCallback", "prepare_trainer"]
