"""Storage: the narrow file interface every run-state and checkpoint write goes through.

Backed by fsspec, so a local path, `s3://` (s3fs) or any fsspec URL works. The interface is small
on purpose (read, atomic write, upload a directory, download files, delete, list) so the commit
protocol in `checkpoint_manager` can be read in one place and tested against a faulty storage.

Atomicity: `write_atomic` is the only way a small document is written. On a local disk it writes a
temporary file and renames it over the target (POSIX rename is atomic); on object stores a single
PUT is atomic and there is no rename, so it is one `pipe_file`.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

FileInfo = dict[str, Any]  # {"size": int, "sha256": str}


def file_digest(path: str) -> FileInfo:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": os.path.getsize(path), "sha256": digest}


def local_files(root: str) -> list[str]:
    """Relative paths of every file under `root`, sorted."""
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            found.append(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/"))
    return sorted(found)


class Storage:
    """Files under one root URL (`storage_path`). Paths given to methods are relative to it."""

    def __init__(self, url: str, options: dict[str, Any] | None = None):
        self.url = url
        self.options = dict(options or {})
        self._fs = None
        self._root = ""

    def __getstate__(self) -> dict:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["options"])

    def __repr__(self) -> str:  # never print storage_options: they may hold secrets
        return f"Storage({self.url!r})"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.options)
        return self._fs

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def full(self, path: str) -> str:
        self.fs  # resolves _root
        return posixpath.join(self._root, path) if path else self._root

    def uri(self, path: str) -> str:
        """A URL a user can paste: the storage URL joined with `path`."""
        return f"{self.url.rstrip('/')}/{path}"

    # -- the interface -----------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        try:
            return self.fs.cat_file(self.full(path))
        except FileNotFoundError:
            return None

    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old content or the new, never a torn file."""
        target = self.full(path)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

    def upload_dir(self, local_dir: str, path: str) -> dict[str, FileInfo]:
        """Copy every file of `local_dir` under `path`; return their sizes and checksums."""
        rels = local_files(local_dir)
        infos = {rel: file_digest(os.path.join(local_dir, rel)) for rel in rels}
        if rels:
            remote = [posixpath.join(self.full(path), rel) for rel in rels]
            if self.is_local:
                for r in {posixpath.dirname(p) for p in remote}:
                    os.makedirs(r, exist_ok=True)
            self.fs.put([os.path.join(local_dir, rel) for rel in rels], remote)
        return infos

    def download_files(self, path: str, rels: list[str], local_dir: str) -> None:
        for d in {os.path.dirname(os.path.join(local_dir, r)) for r in rels}:
            os.makedirs(d, exist_ok=True)
        if rels:
            self.fs.get(
                [posixpath.join(self.full(path), r) for r in rels],
                [os.path.join(local_dir, r) for r in rels],
            )

    def delete_dir(self, path: str) -> None:
        try:
            self.fs.rm(self.full(path), recursive=True)
        except FileNotFoundError:
            pass  # already gone: deleting is idempotent

    def list_dir(self, path: str) -> list[str]:
        """Names directly under `path` (empty if it does not exist)."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.full(path), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)
