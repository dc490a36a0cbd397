"""Storage: the narrow file interface every run-state and checkpoint write goes through.

Backed by fsspec, so a local path, `s3://` (s3fs) or any fsspec URL works. The interface is small
on purpose (read, atomic write, upload a directory, download files, delete, list) so the commit
protocol in `checkpoint_manager` can be read in one place and tested against a faulty storage.

Atomicity: `write_atomic` is the only way a small document is written. On a local disk it writes a
temporary file and renames it over the target (POSIX rename is atomic); on object stores a single
PUT is atomic and there is no rename, so it is one `pipe_file`.

Compare-and-swap: `read_versioned` and `write_if`, for the driver's lease (`lease`). On S3 a
conditional PUT (If-None-Match / If-Match on the ETag); on a local disk the compare and the
rename under an flock held for that write only. Other fsspec stores get the same compare without
the atomicity: two writers within milliseconds of each other may both succeed there.

Files of the same name from several ranks (DESIGN.md, storage invariant 3): the ranks of a round
upload into one directory at once, and none knows the others' file names (report() never waits
for the other ranks). So that the bytes under a name are always those of one known rank,
`upload_dir(rank=r)` writes a name only where no other rank can be overwritten by mistake:

- rank 0 writes `{dir}/f` unconditionally: it is the lowest rank, whose file wins anyway;
- a rank r > 0 creates `{dir}/f` only if it does not exist yet (an exclusive create: locally a
  temporary file hard-linked to the final name, which fails if it exists; on S3 a PUT, or the
  completion of a multipart upload, with `If-None-Match: *`). Where it exists, the rank's bytes
  go to its side path `{dir}/.ft-dup/rank-{r}/f` instead (`side_path`), and its `FileInfo` says
  so (`"at"`: the side path, relative to `{dir}`).

The driver then keeps the lowest rank's file of each name and, where those bytes are at a side
path, moves them into place before it writes the manifest (`checkpoint_manager`). A name that one
rank alone attaches (rank 0's `state.pt`, sharded `__{rank}_0.distcp` files) costs nothing more:
one link locally, a condition on the same PUT on S3. On S3 a collision costs the losing rank a
second upload of that file (the refused one cannot be completed under another key). Other fsspec
stores check that the name is free first, without the atomicity: two ranks within milliseconds
of each other may both write it there, as for `write_if`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import posixpath
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .. import knobs
from .credentials import reveal

FileInfo = dict[str, Any]  # {"size": int, "sha256": str}, and "at": a side path (see above)

DUPLICATES = ".ft-dup"  # under a checkpoint's directory: the side paths of same-named files

# A failed link means "no hard links here" for these (a filesystem without them): side path
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV}

_CHUNK = 8 * 2**20  # bytes read, hashed and written at a time by an upload


class UploadStopped(Exception):
    """An upload was stopped on request (its rank's group failed); not an error of storage."""


# copy_file_range cannot copy here (another filesystem, an old kernel): write from memory instead
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def _copy_chunk(fin: int, fout: int, offset: int, chunk: memoryview, in_kernel: bool) -> bool:
    """Write `chunk`, just read from `fin` at `offset`, to `fout` at the same offset. In the kernel
    where it can (copy_file_range, from the page cache the chunk was read through): a write from
    a Python buffer into the page cache is several times slower inside Dask worker processes.
    Returns whether the kernel copy may be tried for the next chunk."""
    done, n = 0, len(chunk)
    while in_kernel and done < n:
        try:
            copied = os.copy_file_range(fin, fout, n - done, offset + done, offset + done)
        except OSError as e:
            if e.errno not in _NO_COPY_RANGE:
                raise
            copied = 0
        if copied == 0:  # not possible here (or the file shrank): from memory from now on
            in_kernel = False
        done += copied
    while done < n:
        done += os.pwrite(fout, chunk[done:], offset + done)
    return in_kernel


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _replace_local(path: str, data: bytes) -> None:
    """Write a temporary file beside `path` and rename it over `path` (POSIX rename is atomic)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # renamed away (a side path), or never written


def _content_tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _precondition_failed(error: OSError) -> bool:
    """Did S3 refuse a conditional write because the object changed (or appeared, or went)?"""
    code = getattr(error.__cause__, "response", {}).get("Error", {}).get("Code")
    if code == "NoSuchBucket":  # not a race that looking again resolves: the lease would loop
        return False
    if isinstance(error, (FileExistsError, FileNotFoundError)):
        return True
    return code in ("PreconditionFailed", "ConditionalRequestConflict")


def with_s3_retries(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs `options` with botocore's retries and timeouts set to ride out a storage outage of
    `knobs.S3_RETRY_ATTEMPTS` attempts (what the options give themselves is kept). botocore's
    "standard" mode retries a refused or reset connection, a timeout, a 5xx and throttling, with
    exponential backoff and jitter. (s3fs tries again, 5 times, what botocore gave up on after
    a timeout, not after a refused connection.)"""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault(
        "retries", {"mode": "standard", "total_max_attempts": knobs.S3_RETRY_ATTEMPTS}
    )
    config.setdefault("connect_timeout", knobs.S3_CONNECT_TIMEOUT_S)
    config.setdefault("read_timeout", knobs.S3_READ_TIMEOUT_S)
    return {**options, "config_kwargs": config}


def unreachable(error: BaseException) -> bool:
    """Did `error` come from storage that could not be reached (a refused or reset connection, a
    timeout), after the client's own retries? Not an answer from storage (denied, not found):
    what a wait may fix, not what it cannot."""
    retryable: tuple[type, ...] = (ConnectionError, TimeoutError)
    try:
        import botocore.exceptions as boto

        retryable += (boto.ConnectionError, boto.HTTPClientError)
    except ImportError:  # no s3fs here: only the builtin kinds
        pass
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, retryable):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


def file_digest(path: str) -> FileInfo:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": os.path.getsize(path), "sha256": digest}


def side_path(rank: int, rel: str) -> str:
    """Where rank `rank` puts its file `rel` when another rank created `rel` first (relative to
    the checkpoint's directory)."""
    return f"{DUPLICATES}/rank-{rank}/{rel}"


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
        self.options = reveal(dict(options or {}))  # credentials plain, in memory only
        self._fs = None
        self._root = ""

    def __getstate__(self) -> dict:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict) -> None:
        Storage.__init__(self, state["url"], state["options"])

    def __repr__(self) -> str:  # never print storage_options: they may hold secrets
        return f"Storage({self.url!r})"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            options = self.options
            if self.url.startswith(("s3://", "s3a://")):
                options = with_s3_retries(options)
            self._fs, self._root = fsspec.core.url_to_fs(self.url, **options)
        return self._fs

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def full(self, path: str) -> str:
        _ = self.fs  # resolves _root
        return posixpath.join(self._root, path) if path else self._root

    def uri(self, path: str) -> str:
        """A URL a user can paste: the storage URL joined with `path`."""
        return f"{self.url.rstrip('/')}/{path}"

    def unusable(self) -> str | None:
        """Why no run can be created under the root, with the fix, or None: a local path where
        a file stands in for a directory, or that cannot be written; a bucket that does not
        exist (a write would fail only after the run had started)."""
        if self.is_local:
            existing = self.full("")
            while not os.path.exists(existing) and os.path.dirname(existing) != existing:
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                return f"{existing} is a file, not a directory: give a directory"
            if not os.access(existing, os.W_OK):
                return f"{existing} is not writable: give a directory you can write to"
            return None
        if self._is_s3:
            bucket = self.full("").split("/")[0]
            if not self.fs.exists(bucket):
                client = self.options.get("client_kwargs") or {}
                at = self.options.get("endpoint_url") or client.get("endpoint_url")
                where = f" at {at}" if at else ""
                return f"bucket {bucket!r} does not exist{where}: create it, or give an existing bucket"
        return None

    # -- the interface -----------------------------------------------------------------------

    def read_bytes(self, path: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        try:
            return self._cat(self.full(path))
        except FileNotFoundError:
            return None

    def read_many(self, paths: list[str]) -> dict[str, bytes]:
        """The bytes of each of `paths` that exists, by path; fetched concurrently from an object
        store (fsspec's `cat` of a list)."""
        if not paths:
            return {}
        wanted = {self.fs._strip_protocol(self.full(p)): p for p in paths}
        options = {"max_concurrency": 1} if self._is_s3 else {}  # one GET each, as in _cat
        got = self.fs.cat(list(wanted), on_error="omit", **options)
        return {wanted[self.fs._strip_protocol(k)]: v for k, v in got.items()}

    def _cat(self, full: str) -> bytes:
        if self._is_s3:  # one GET: s3fs would first ask the size (a HEAD), to split large reads
            return self.fs.cat_file(full, max_concurrency=1)
        return self.fs.cat_file(full)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old content or the new, never a torn file."""
        target = self.full(path)
        if self.is_local:
            _replace_local(target, data)
        else:
            self.fs.pipe_file(target, data)

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        """The object's bytes and a tag of this version of it (for `write_if`), or None when it
        does not exist."""
        full = self.full(path)
        try:
            if self._is_s3:
                self.fs.invalidate_cache(full)
                # the tag first: should the object change in between, a write_if fails
                etag = self.fs.info(full)["ETag"].strip('"')
                return self._cat(full), etag
            data = _read_local(full) if self.is_local else self._cat(full)
        except FileNotFoundError:
            return None
        return data, _content_tag(data)

    def write_if(self, path: str, data: bytes, tag: str | None) -> str | None:
        """Write `data` only if the object is still the version `tag` (from `read_versioned`),
        or, with `tag` None, does not exist. Returns the new version's tag, or None (nothing
        written) when another writer changed it first."""
        target = self.full(path)
        if self._is_s3:
            condition = {"mode": "create"} if tag is None else {"IfMatch": tag}
            try:
                return self.fs.pipe_file(target, data, **condition)["ETag"].strip('"')
            except OSError as e:
                if _precondition_failed(e):
                    return None
                raise
        if not self.is_local:  # not atomic: see the module's docstring
            stored = self.read_versioned(path)
            if (None if stored is None else stored[1]) != tag:
                return None
            self.fs.pipe_file(target, data)
            return _content_tag(data)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd = os.open(f"{target}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # against other processes' and threads' write_if
            try:
                current: bytes | None = _read_local(target)
            except FileNotFoundError:
                current = None
            if (None if current is None else _content_tag(current)) != tag:
                return None
            _replace_local(target, data)
            return _content_tag(data)
        finally:
            os.close(fd)

    @property
    def _is_s3(self) -> bool:
        protocol = self.fs.protocol
        return "s3" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))

    def upload_dir(
        self,
        local_dir: str,
        path: str,
        should_stop: Callable[[], bool] | None = None,
        rank: int = 0,
    ) -> dict[str, FileInfo]:
        """Copy every file of `local_dir` under `path`; return their sizes and checksums.

        Each file is read once: its sha256 is computed from the chunks as they are written.
        `rank` is the uploading rank: rank 0 writes every file in place; a higher rank creates a
        file in place only where no other rank has, else writes it to its side path and says so
        in the file's `"at"` (see the module's docstring). `should_stop` is asked between
        chunks; when it says so, `UploadStopped` is raised and the files written so far stay
        behind (an uncommitted directory: the driver's `collect_orphans` removes it)."""
        rels = local_files(local_dir)
        infos = {}
        base = self.full(path)
        if self.is_local:
            for d in {posixpath.dirname(posixpath.join(base, r)) for r in rels}:
                os.makedirs(d, exist_ok=True)
        for rel in rels:
            src = os.path.join(local_dir, rel)
            if rank == 0:
                infos[rel] = self._put_file(src, posixpath.join(base, rel), should_stop)
            else:
                infos[rel] = self._create_file(src, base, rel, side_path(rank, rel), should_stop)
        return infos

    def _create_file(
        self, src: str, base: str, rel: str, side: str, should_stop: Callable[[], bool] | None
    ) -> FileInfo:
        """Upload `src` to `{base}/{rel}` only if no file is there yet; else to `{base}/{side}`,
        and then the returned info says so (`"at": side`)."""
        dst = posixpath.join(base, rel)
        if self.is_local:
            # The whole file under a temporary name, then linked to its own: the link fails if
            # the name exists, and never shows a half-written file under it.
            tmp = f"{dst}.ft-tmp-{uuid.uuid4().hex[:8]}"
            try:
                info = self._put_file(src, tmp, should_stop)
                try:
                    os.link(tmp, dst)
                    return info
                except OSError as e:
                    if not isinstance(e, FileExistsError) and e.errno not in _NO_LINK:
                        raise
                    if os.path.isdir(dst):  # not another rank's file: what rank 0 would hit
                        raise IsADirectoryError(
                            errno.EISDIR, "a directory is in the way", dst
                        ) from e
                # another rank's file is there (or this filesystem has no hard links): the
                # driver moves these bytes into place if this rank's file wins
                full_side = posixpath.join(base, side)
                os.makedirs(posixpath.dirname(full_side), exist_ok=True)
                os.replace(tmp, full_side)
                return {**info, "at": side}
            finally:
                _unlink_quiet(tmp)
        if self._is_s3:
            try:
                return self._put_file(src, dst, should_stop, exclusive=True)
            except OSError as e:
                # Refused: the name exists, or another conditional write of it was under way
                # (409). Either way the side path is safe: the driver moves the winner's bytes.
                if not _precondition_failed(e):
                    raise
        elif not self.fs.exists(dst):  # not atomic: see the module's docstring
            return self._put_file(src, dst, should_stop)
        return {**self._put_file(src, posixpath.join(base, side), should_stop), "at": side}

    def _put_file(
        self,
        src: str,
        dst: str,
        should_stop: Callable[[], bool] | None,
        exclusive: bool = False,
    ) -> FileInfo:
        """Copy one file, hashing each chunk as it passes: the file is read once. `exclusive`
        (S3 only): only if `dst` does not exist yet, else `FileExistsError` (a PUT, or the
        completion of a multipart upload, with If-None-Match)."""
        if exclusive and os.path.getsize(src) == 0:  # s3fs writes an empty file unconditionally
            self.fs.pipe_file(dst, b"", mode="create")
            return {"size": 0, "sha256": hashlib.sha256().hexdigest()}
        digest, size = hashlib.sha256(), 0
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        local = self.is_local
        in_kernel = local and hasattr(os, "copy_file_range")
        # A local target is a plain file; elsewhere fsspec's buffered writer (on S3, one PUT for a
        # small file, a multipart upload of 50 MiB parts for a large one). After an error the
        # part written so far may stay behind: harmless, as no manifest will ever list it.
        with open(src, "rb", buffering=0) as f:
            out = (
                open(dst, "wb", buffering=0)
                if local
                else self.fs.open(dst, "xb" if exclusive else "wb")
            )
            try:
                with out:
                    while n := f.readinto(buf):
                        if should_stop is not None and should_stop():
                            raise UploadStopped(f"upload of {src} stopped")
                        digest.update(view[:n])
                        if local:
                            in_kernel = _copy_chunk(
                                f.fileno(), out.fileno(), size, view[:n], in_kernel
                            )
                        else:
                            out.write(view[:n])
                        size += n
            except FileExistsError:  # refused at its completion (exclusive): nothing was stored
                discard = getattr(out, "discard", None)
                if discard is not None:  # a multipart upload's parts would stay, and be billed
                    discard()
                raise
        return {"size": size, "sha256": digest.hexdigest()}

    def move_file(self, src: str, dst: str) -> None:
        """Move the file `src` to `dst`, replacing what is there: at a commit, the winning rank's
        bytes from their side path into place. Locally a rename; on S3 a copy inside the store
        (no bytes through this process) and a delete."""
        if self.is_local:
            os.replace(self.full(src), self.full(dst))
        else:
            self.fs.mv(self.full(src), self.full(dst))

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
