"""The `ft-train` command line: an adapter over the library, beside `flows/` and `tasks/`.

    main.py     the parser, the dispatch to a command, exit codes and a closed pipe
    run.py      `ft-train run MODULE:FUNCTION`: any training function, as the Prefect flow
    launch.py   what `run` and `demo` share: the flow's call, the quiet console, the end
    progress.py the progress bar, fed by the run's stored state
    demo.py     `ft-train demo`: the demo deployment's parameters (`deployments/demo.py`),
                trained as the Prefect flow in ephemeral mode
    runs.py     `ft-train status` and `ft-train list`: read storage only, no Prefect
    common.py   what the commands share: exit codes, storage options, reading a stored run
    output.py   a run's summary as a person reads it

Importing any of them does not import Prefect: `run` and `demo` import `flows.train` when they
train.
"""
