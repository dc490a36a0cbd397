"""`ft-train dask-config`: the Dask settings ft-train gives the clusters it starts, as a YAML
file for a scheduler and workers that it does not start (`docs/clusters.md`)."""

from __future__ import annotations

import argparse

from .common import EXIT_OK

HEADER = """\
# ft-train's settings for a Dask scheduler and its workers (`ft-train dask-config`).
# Put this file in /etc/dask/ or ~/.config/dask/, or point DASK_CONFIG at it, on every host
# before `dask scheduler` and `dask worker` start. It keeps Dask from re-running a rank, lets a
# rank start processes, and stops the profiler and timers that take a rank's CPU.
# `dask worker` ignores the preloads below: give them on its command line,
#   dask worker ADDRESS --nthreads 1 --preload-nanny ft_train.worker.forkserver \
#       --preload ft_train.driver.cluster
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "dask-config",
        help="print the Dask settings for a scheduler and workers that ft-train does not start",
        description="Print, as YAML, the Dask settings ft-train gives the clusters it starts. "
        "Save it where Dask looks for its config (/etc/dask/, ~/.config/dask/, or DASK_CONFIG) "
        "on the hosts of an existing cluster.",
    )
    p.set_defaults(command_fn=run_dask_config, command_parser=p)


def run_dask_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import yaml

    from ft_train.driver.dask_settings import dask_config

    print(HEADER + yaml.safe_dump(dask_config(), sort_keys=False), end="")
    return EXIT_OK
