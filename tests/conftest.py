"""Shared test fixtures: one Prefect test harness per session, a loopback S3 endpoint, and the
`storage` fixture that runs every storage-touching test against a local path and against s3://.
"""

import contextlib
import os
import tempfile
import uuid
from dataclasses import dataclass, field

# Before anything imports Prefect: its home and database live in a temporary folder, one for
# each of pytest-xdist's test processes (an ephemeral server's database is in it, and two
# processes' servers would share it).
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="ft-train-prefect-"))
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["PREFECT_HOME"] = os.path.join(os.environ["PREFECT_HOME"], worker)
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
for k, v in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ[k] = v
os.environ.pop("AWS_PROFILE", None)

import multiprocessing  # noqa: E402

import pytest  # noqa: E402

from deployments.demo import CLUSTER as DEMO_CLUSTER  # noqa: E402

# Most tests train the demo on a local cluster: its workers' fork server imports what the demo
# imports, as `ft-train demo` has it do (each failure replaces the group's processes). Python's
# own hook, which ft-train honours as it does `ClusterConfig.preload`.
multiprocessing.set_forkserver_preload(list(DEMO_CLUSTER["preload"]))


# The modules that take longest, first: pytest-xdist (`--dist loadfile`, pyproject.toml) hands
# out whole modules in collection order, so a long module collected last would run on one
# process while the other has finished. From the suite's `--durations` on 2 cores.
LONGEST_FIRST = [
    "test_slurm.py",
    "test_first_hour.py",
    "test_recovery_e2e.py",
    "test_demo_cli.py",
    "test_node_failures.py",
    "test_chaos.py",
    "test_ui_screenshot.py",
    "test_snapshots.py",
    "test_lint.py",
    "test_driver_failures.py",
    "test_deployment_e2e.py",
    "test_ray_compat.py",
    "test_example_deployments.py",
]


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order


def _pre_spawn_variables() -> dict[str, str | None]:
    import dask
    import distributed  # noqa: F401  (its defaults hold the variables' names)

    names = list(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    return {k: os.environ.get(k) for k in names}


_PRE_SPAWN_AT_START = _pre_spawn_variables()  # as this process starts, before any nanny


@pytest.fixture(autouse=True)
def _dask_pre_spawn_variables_restored():
    """A Dask nanny started in the test process (a test's own `LocalCluster`, as a user starts
    one) sets Dask's pre-spawn variables (`MALLOC_TRIM_THRESHOLD_`, `OMP_NUM_THREADS`, ...) in
    the process's environment for good, each time it starts a worker, and ft-train's local
    workers see the driver's environment. After each test the variables are back to their
    values at the session's start, whichever modules ran before it in its process: not to their
    values before the test, which a module's cluster set up before its first test has changed
    already."""
    yield
    for k, v in _PRE_SPAWN_AT_START.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (the test harness) shared by the session; yields its URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def postgres_database(tmp_path_factory):
    """A PostgreSQL server of the session's own (`tests/postgres.py`) with a database for
    Prefect; yields its SQLAlchemy URL. Skips where PostgreSQL is not installed (fails under
    CI, which installs it)."""
    from tests import postgres
    from tests.helpers import needs

    needs("Prefect on PostgreSQL", postgres.unavailable())
    with postgres.postgres_server(tmp_path_factory.mktemp("postgres")) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_api(postgres_database, tmp_path_factory):
    """`prefect server start` on `postgres_database`, for the whole session; yields its API URL."""
    from tests import postgres

    with postgres.prefect_server(postgres_database, tmp_path_factory.mktemp("prefect")) as api:
        yield api


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 endpoint on loopback (moto's threaded server), for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@contextlib.contextmanager
def moto_checks_credentials():
    """The loopback S3 endpoint checks access keys within the block (moto accepts any key
    unless told to check them); it knows none, so every key is wrong."""
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = ActionAuthenticatorMixin.request_count = 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before


@dataclass
class StorageTarget:
    kind: str
    path: str
    options: dict = field(default_factory=dict)


def make_s3_target(endpoint: str) -> StorageTarget:
    import s3fs

    bucket = f"ft-{uuid.uuid4().hex[:12]}"
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
    return StorageTarget("s3", f"s3://{bucket}/runs", options)


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> StorageTarget:
    """Where a test's runs live: a local directory, then a fresh bucket on the loopback S3.

    Tests of storage itself (test_storage_invariants, test_report_path, the CLI demo) run on
    both. Tests of failure handling run on one each, named with `on_storage` (an `indirect`
    parametrization), and a file's tests spread over the two: they test the controller, which
    reaches storage only through `Storage`, and a second run of each would double the suite's
    slowest part (about 4 of its 16-20 minutes)."""
    if request.param == "local":
        return StorageTarget("local", str(tmp_path / "runs"))
    return make_s3_target(request.getfixturevalue("s3_endpoint"))


def on_storage(kind: str) -> pytest.MarkDecorator:
    """Run a test on one of the `storage` fixture's targets ("local" or "s3") only."""
    return pytest.mark.parametrize("storage", [kind], indirect=True)


# The quick lane's time in every full run's summary (`tests/unit`: under a minute is its budget).
_quick_lane = {"tests": 0, "seconds": 0.0}


def pytest_runtest_logreport(report) -> None:
    if report.nodeid.startswith("tests/unit/"):
        _quick_lane["seconds"] += report.duration  # setup, call and teardown
        _quick_lane["tests"] += report.when == "call"


def pytest_terminal_summary(terminalreporter) -> None:
    if _quick_lane["tests"]:
        terminalreporter.write_line(
            f"quick lane (tests/unit): {_quick_lane['tests']} tests, "
            f"{_quick_lane['seconds']:.1f} s of test time"
        )
