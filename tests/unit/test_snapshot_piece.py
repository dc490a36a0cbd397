"""The snapshot tier's typed piece and its one wire form, and the package that says what the
tier is (`ft_train.snapshots`)."""

from __future__ import annotations

import pathlib

import pytest

import ft_train.snapshots
from ft_train.snapshots.piece import SnapshotPiece, SnapshotRound, parse_where
from ft_train.snapshots.rounds import SnapshotTier


def test_a_piece_crosses_the_wire_and_comes_back_the_same():
    sent = SnapshotPiece("a0", 1, 26, "snapshot", world_size=2, size=10)
    held = sent.held_by("tcp://n1:1", "/dev/shm/ft-train-snapshots/x")
    for piece in (sent, held):
        assert SnapshotPiece.from_dict(piece.to_dict()) == piece
    assert held.round_key == sent.round_key == ("a0", 26, "snapshot")
    assert (held.holder, held.path) == ("tcp://n1:1", "/dev/shm/ft-train-snapshots/x")


@pytest.mark.parametrize(
    ("wire", "says"),
    [
        ({"attempt_id": "a0", "rank": 0, "index": 2, "kind": "snapshot", "size": 1}, "world_size"),
        ({**SnapshotPiece("a0", 0, 2, "jit", 1, 1).to_dict(), "kind": "zip"}, "kind 'zip'"),
    ],
)
def test_what_is_not_a_piece_is_refused_naming_what_is_wrong(wire, says):
    with pytest.raises(ValueError, match=says):
        SnapshotPiece.from_dict(wire)


def test_a_rounds_name_in_an_error_reads_back_to_mark_it_unusable():
    rnd = SnapshotRound("a0", 26, "jit", (SnapshotPiece("a0", 0, 26, "jit", 2, 1, "h"),))
    assert parse_where(rnd.where) == ("a0", 26) and parse_where("s3://b/ck") is None
    tier = SnapshotTier(lineage=["a0"])
    assert tier.unusable(rnd.where) and ("a0", 26, "snapshot") in tier.bad
    assert tier.choose(list(rnd.pieces), newer_than=0) is None


def test_the_packages_docstring_names_each_of_its_modules():
    doc = ft_train.snapshots.__doc__ or ""
    here = pathlib.Path(ft_train.snapshots.__file__).parent
    modules = sorted(p.stem for p in here.glob("*.py") if p.stem != "__init__")
    assert [m for m in modules if f"`{m}`" not in doc] == []
