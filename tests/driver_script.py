"""A driver process for tests that kill the driver: runs the demo flow (or `train_loop`, with
`max_failures` and `callbacks`, where given) from JSON arguments."""

import faulthandler
import json
import signal
import sys

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waits in vain asks
    # Ctrl+C as in a terminal, even where the tests run as a shell's background job (which
    # starts them, and so this process, with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = json.loads(sys.argv[1])
    sys.path.insert(0, args["repo"])
    import ft_train
    from deployments import demo
    from flows.train import train

    train(
        train_loop=args.get("train_loop", demo.TRAIN_LOOP),
        train_loop_config=args["config"],
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=args["name"],
            storage_path=args["storage_path"],
            storage_options=args["storage_options"],
            failure_config=ft_train.FailureConfig(max_failures=args.get("max_failures", 0)),
            callbacks=args.get("callbacks", []),
        ),
    )
