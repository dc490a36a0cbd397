"""`python -m bench.scale`'s machinery at 8 ranks, so that it cannot rot: simulated ranks drive the
real controller, session, journals and storage through rounds, a commit and a lost rank, and the
run state it left is the one a run leaves (bench/README.md has the figures at 1 024 ranks)."""

from __future__ import annotations

import json

import pytest

from bench import scale
from ft_train.storage.checkpoint import MANIFEST
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore

pytestmark = pytest.mark.timeout(60)


def test_the_scale_benchmark_runs_at_8_ranks(tmp_path, capsys):
    out = tmp_path / "figures.json"
    argv = ["--ranks", "8", "--commits", "2", "--metrics-rounds", "5", "--checkpoints", "300"]
    assert scale.main([*argv, "--json", str(out)]) == 0
    [figures] = json.loads(out.read_text())
    assert figures["ranks"] == 8
    for name in ("commit_s", "round_s", "teardown_s", "cpu_metrics_s", "cpu_checkpoint_s"):
        assert 0 < figures[name] < 10, name
    # 300 checkpoints with num_to_keep=None: two chunks of 128 sealed, the head bounded
    assert figures["index_bytes"] > figures["head_bytes"] > 0
    assert figures["load_head_s"] > 0 and figures["load_index_s"] > 0
    printed = capsys.readouterr().out
    assert "| commit, local (s) |" in printed and "MET: commit, local" in printed


def test_its_ranks_leave_the_run_state_a_run_leaves(tmp_path):
    storage = Storage(str(tmp_path / "runs"))
    scale.run_group(8, storage, metrics_rounds=3, commits=2)
    state = RunStore(storage, "scale-8").load()
    assert state is not None
    # the first checkpoint, 3 metrics-only rounds and a checkpoint, 2 checkpoints; then rank 7 died
    assert [c.report_index for c in state.checkpoints] == [1, 5, 6, 7]
    assert state.latest == state.checkpoints[-1].dir_name and state.report_index == 7
    assert [(f.kind, f.rank, f.step) for f in state.failures] == [("process_death", 7, 7)]
    assert state.attempts[0].world_size == 8
    manifest = json.loads(storage.read_bytes(f"scale-8/{state.latest}/{MANIFEST}") or b"")
    assert sorted(manifest["files"]) == sorted(f"rank{r}.pt" for r in range(8))
    for rel, info in manifest["files"].items():
        assert storage.fs.size(storage.full(f"scale-8/{state.latest}/{rel}")) == info["size"]
