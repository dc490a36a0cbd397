"""`Checkpoint`: a directory of files, local or on storage, and how a rank gets at it.

A committed checkpoint lives at `{storage_path}/{name}/{dir_name}/` and holds the files of every
rank that attached one in its report round plus `MANIFEST` (files, sizes, sha256), written last.
Reading goes through the manifest: only listed files are fetched and each is verified, so a
half-written directory can never be restored.

Metadata (Ray's `get_metadata` / `set_metadata` / `update_metadata`): a JSON object in the file
`.metadata.json` of the checkpoint's directory, as Ray stores it. Written into a local directory
before report(), it is one of the checkpoint's files like any other (uploaded, listed in the
manifest, verified on read). A committed checkpoint is read-only: its manifest lists every file
with its checksum, and a file written after the commit would either not be listed or no longer
match, so `set_metadata`/`update_metadata` on it raise a SessionError; `get_metadata` reads
the committed file, verified against the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointDamagedError, SessionError, StorageError
from ..ray_names import RefusesRayNames
from ..worker import download_cache, scratch
from .fs import Storage, file_digest

MANIFEST = ".ft_manifest.json"
METADATA = ".metadata.json"  # Ray's name for a checkpoint's metadata file


def _inside(rel: Any) -> bool:
    """Is `rel` a relative path that stays inside its checkpoint's directory?"""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        return False
    parts = rel.split("/")
    return not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts)


class Checkpoint(RefusesRayNames):
    """A checkpoint directory: `path` is a local directory or a URL, read with `storage_options`."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None):
        self.path = str(path)
        self.storage_options = dict(storage_options or {})

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            # A SessionError, not FileNotFoundError: in a rank it ends the run at once (no
            # retry saves to a directory that the training function never created).
            raise SessionError(
                f"Checkpoint.from_directory({path!r}): there is no such directory; save the "
                "checkpoint's files into a directory first, then pass that directory"
            )
        return cls(path)

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def _storage(self) -> Storage:
        return Storage(self.path, self.storage_options)

    def manifest(self) -> dict[str, Any]:
        raw = self._storage().read_bytes(MANIFEST)
        if raw is None:
            raise StorageError(f"{self.path} has no {MANIFEST}: it was never committed")
        try:
            manifest = json.loads(raw)
            files = manifest["files"]
            if not isinstance(files, dict):
                raise TypeError(f"'files' is a {type(files).__name__}, not an object")
            bad = next((rel for rel in files if not _inside(rel)), None)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointDamagedError(
                f"{self.path}/{MANIFEST} is not a manifest ({type(e).__name__}: {e}): the stored "
                "checkpoint is damaged; delete it, or restore it from a copy",
                self.path,
            ) from None
        if bad is not None:
            # Never follow it: a restore would read, and write, a file outside the checkpoint.
            raise CheckpointDamagedError(
                f"{self.path}/{MANIFEST} lists {bad!r}, a path outside the checkpoint: it was not "
                "written by ft-train, or was altered; delete the checkpoint, or restore it from a "
                "copy",
                self.path,
            )
        return manifest

    def _is_local(self) -> bool:
        return "://" not in self.path or self.path.startswith("file://")

    def is_committed(self) -> bool:
        """A checkpoint ft-train committed (its manifest exists), rather than a local directory
        a training function is about to report. A remote one always counts as committed."""
        if not self._is_local():
            return True
        return os.path.exists(os.path.join(self._storage().full(""), MANIFEST))

    # -- metadata (Ray's API; see the module docstring) -----------------------------------------

    def get_metadata(self) -> dict[str, Any]:
        """The checkpoint's metadata ({} if none was set)."""
        if not self.is_committed():
            path = os.path.join(self._storage().full(""), METADATA)
            if not os.path.exists(path):
                return {}
            with open(path, "rb") as f:
                return _metadata_doc(f.read(), path)
        want = self.manifest()["files"].get(METADATA)
        if want is None:
            return {}
        raw = self._storage().read_bytes(METADATA)
        if raw is None or len(raw) != want["size"] or _sha256(raw) != want["sha256"]:
            raise CheckpointDamagedError(
                f"{self.path}/{METADATA} is missing or does not match its manifest: the stored "
                "checkpoint is damaged",
                self.path,
            )
        return _metadata_doc(raw, f"{self.path}/{METADATA}")

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Replace the checkpoint's metadata (a JSON-serialisable dict); before report() only."""
        self._write_metadata(_checked_metadata(metadata, "set_metadata"), "set_metadata")

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Merge `metadata` into the checkpoint's metadata (dict.update); before report() only."""
        merged = {**self.get_metadata(), **_checked_metadata(metadata, "update_metadata")}
        self._write_metadata(merged, "update_metadata")

    def _write_metadata(self, metadata: dict[str, Any], what: str) -> None:
        if self.is_committed():
            raise SessionError(
                f"Checkpoint.{what}() on {self.path}: a committed checkpoint is read-only (its "
                "manifest lists every file with its checksum); set the metadata on the local "
                "directory before report(), e.g. Checkpoint.from_directory(d).set_metadata({...}),"
                " or copy it with to_directory() and report the copy"
            )
        directory = self._storage().full("")
        fd, tmp = tempfile.mkstemp(prefix=METADATA, dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(metadata, f)
            os.replace(tmp, os.path.join(directory, METADATA))  # never a half-written file
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory with the checkpoint's files, for reading only.

        A local checkpoint is yielded in place. A remote one is downloaded once per node into a
        cache shared by the ranks of that node (`download_cache`), and verified against its
        manifest; the directory stays until the block ends, and may be evicted after.
        """
        if self._is_local():
            path = self._storage().full("")
            if os.path.exists(os.path.join(path, MANIFEST)):  # a committed checkpoint
                self._verify(path, self.manifest()["files"])
            yield path
        else:
            root = scratch.folder(download_cache.CACHE)
            with download_cache.cached(root, self.path, self.download_verified) as path:
                yield path

    def to_directory(self, path: str | None = None) -> str:
        """Copy the checkpoint into `path` (a new temporary directory by default); return it."""
        path = path or tempfile.mkdtemp(prefix="ft-train-checkpoint-")
        with self.as_directory() as src:
            shutil.copytree(src, path, dirs_exist_ok=True)
        return path

    def download_verified(self, local_dir: str) -> None:
        """Fetch the manifest's files into `local_dir` and check every size and checksum."""
        manifest = self.manifest()
        files = manifest["files"]
        storage = self._storage()
        try:
            storage.download_files("", sorted(files), local_dir)
        except FileNotFoundError:
            missing = [r for r in sorted(files) if not storage.fs.exists(storage.full(r))]
            raise CheckpointDamagedError(
                f"{self.path}: {', '.join(missing) or 'a file'} listed in its manifest is missing: "
                "the stored checkpoint is damaged",
                self.path,
            ) from None
        self._verify(local_dir, files)
        with open(os.path.join(local_dir, MANIFEST), "w") as f:
            json.dump(manifest, f)

    def _verify(self, local_dir: str, files: dict[str, Any]) -> None:
        for rel, want in files.items():
            full = os.path.join(local_dir, rel)
            if not os.path.isfile(full):
                raise CheckpointDamagedError(
                    f"{self.path}/{rel} is missing: the stored checkpoint is damaged", self.path
                )
            got = file_digest(full)
            if got != {"size": want["size"], "sha256": want["sha256"]}:
                raise CheckpointDamagedError(
                    f"{self.path}/{rel} does not match its manifest (size {got['size']} vs "
                    f"{want['size']}): the stored checkpoint is damaged",
                    self.path,
                )


def _checked_metadata(metadata: Any, what: str) -> dict[str, Any]:
    """`metadata` as it will read back: a dict that JSON carries unchanged in meaning."""
    if not isinstance(metadata, dict):
        raise TypeError(
            f"Checkpoint.{what}() takes a dict, not {type(metadata).__name__}: e.g. "
            "{'epoch': 3, 'framework': 'torch'}"
        )
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"Checkpoint.{what}(): the metadata must be JSON-serialisable ({e}); use numbers, "
            "strings, lists and dicts (e.g. str(value) for anything else)"
        ) from None


def _metadata_doc(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise StorageError(f"{where} is not JSON ({e}): write it with set_metadata()") from None
    if not isinstance(doc, dict):
        raise StorageError(f"{where} is not a JSON object: write it with set_metadata()")
    return doc


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
