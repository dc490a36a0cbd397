"""What a snapshot piece's bytes are: its two formats, written down once, and their CRC-32s.

A piece is one blob, the same bytes wherever it is: in a holder's memory, in a file of the
host's shared memory (`piece_files`), on the wire. Its first bytes say which format it is
(`is_flat`): `MAGIC`, else a zip.

**Flat** (`FlatStager.stage`, then `seal`): `report(snapshot={"rank0.pt": state, ...})` and
`enable_jit_checkpoint(files=...)`. torch.save and a zip around it would cost the rank CPU at
every snapshot round, on its own cores, beside its training. Here the rank copies the state's
tensors into one buffer it keeps, behind a header (the state's structure, pickled with each
tensor as a reference), and a background pass writes the CRC-32 of the rest into the prefix. No
file is written until a restore: then the state is rebuilt from the buffer and saved with
torch.save, as the rank would have saved it (storage shared between two different tensors comes
back as two copies of the same values). Little-endian throughout:

    [0:8)       MAGIC, b"FTSTATE1"
    [8:12)      CRC-32 (zlib's) of every byte from 12 to the end: header length, tensors, header
    [12:16)     the header's length H
    [16:64)     unused
    [64:-H)     the tensors' bytes, each contiguous, each at an offset that is a multiple of 64
    [-H:]       the header: a pickle of (the state's pickle, where each tensor is the persistent
                id ("tensor", i); the layout, for each tensor i: (offset, byte count, dtype,
                shape, whether a Parameter, requires_grad))

Only plain tensors go flat: strided, of torch.Tensor or nn.Parameter, not quantized, nested or
meta. A state with another (sparse, quantized, a subclass) raises `NotPlain` and is saved as a
zip instead, at once, on the rank's thread (`pack_state`).

**Zip** (`pack`, `pack_state`): `report(snapshot=save)` and `enable_jit_checkpoint(save=...)`
(what `save(directory)` wrote, by path relative to the directory), and a state that is not
plain (a `torch.save` of each file's state, one entry per file name). Entries are stored, not
compressed; the zip format keeps a CRC-32 of each entry, which zipfile writes as it packs.

**The check** (`whole`): a restoring rank checks every piece before it uses it, a pass over its
bytes: a flat piece's CRC-32 against its prefix, a zip's entries against theirs (`testzip`); a
piece that fails (or is no piece at all any more) raises ValueError, and the rank takes the
piece's next copy, or fails the round (`rank`). CRC-32, not a cryptographic hash: it is there to
find memory or bytes damaged by accident (a bit flip, a torn file), zlib computes it without the
GIL, and a zip has it already. A holder never checks (`store` says why).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..worker import scratch

MAGIC = b"FTSTATE1"
_PREFIX = struct.Struct("<II")  # CRC-32, header length (after MAGIC)
_ALIGN = 64
_DATA = 64  # where the tensors start


class NotPlain(Exception):
    """A tensor this format does not take (sparse, quantized, a subclass): torch.save it."""


class _Pickler(pickle.Pickler):
    """Pickles the state with each tensor as ("tensor", index): `tensors` in order, each once."""

    def __init__(self, f: io.BytesIO):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided:
            raise NotPlain(type(obj).__name__)
        if obj.is_quantized or obj.is_nested or obj.is_meta:
            raise NotPlain(str(obj.dtype))
        if id(obj) not in self._index:
            self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return ("tensor", self._index[id(obj)])


class FlatStager:
    """Stages {file name: state} into one buffer, kept for the next round where the tensors are
    laid out the same (`reuse`: False where a holder may keep a view of it, in this process)."""

    def __init__(self, reuse: bool, pin: bool = False):
        self.reuse, self.pin = reuse, pin
        self._layout: list[tuple] = []
        self._buffer: torch.Tensor | None = None

    def stage(self, files: Mapping[str, Any]) -> memoryview:
        """The piece: the state's tensors copied now (the training goes on changing them), its
        CRC-32 not yet written (`seal`). NotPlain where a tensor is not plain; what pickle raises
        where the rest of the state cannot be pickled."""
        f = io.BytesIO()
        pickler = _Pickler(f)
        pickler.dump(dict(files))
        layout, end = [], _DATA
        for t in pickler.tensors:
            nbytes = t.numel() * t.element_size()
            param = isinstance(t, torch.nn.Parameter)
            layout.append((end, nbytes, t.dtype, tuple(t.shape), param, t.requires_grad))
            end += -(-nbytes // _ALIGN) * _ALIGN
        header = pickle.dumps((f.getvalue(), layout), protocol=pickle.HIGHEST_PROTOCOL)
        size = end + len(header)
        buf = self._buffer
        if not (self.reuse and buf is not None and layout == self._layout and len(buf) >= size):
            buf = self._buffer = torch.empty(size + 4096, dtype=torch.uint8, pin_memory=self.pin)
            self._layout = layout
        view = buf.numpy().data  # a memoryview
        view[: len(MAGIC)] = MAGIC
        _PREFIX.pack_into(view, len(MAGIC), 0, len(header))
        view[end:size] = header
        with torch.no_grad():
            for t, (at, nbytes, *_) in zip(pickler.tensors, layout, strict=True):
                if nbytes:
                    buf[at : at + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
        return view[:size]

    def close(self) -> None:
        self._buffer, self._layout = None, []


def _scratch() -> str:
    """Where a snapshot is written before it is packed: memory where the node has it, in a
    directory of this process's own (a killed rank's is swept: `scratch.process_dir`)."""
    return scratch.process_dir(scratch.folder("ft-train-packing", memory=True))


def pack(save: Callable[[str], Any]) -> memoryview:
    """Call `save` into a fresh directory and return what it wrote as one zip blob."""
    d = tempfile.mkdtemp(dir=_scratch())
    try:
        save(d)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for root, _, names in os.walk(d):
                for name in sorted(names):
                    path = os.path.join(root, name)
                    z.write(path, os.path.relpath(path, d))
        return buf.getbuffer()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def pack_state(files: Mapping[str, Any]) -> memoryview:
    """`torch.save` each file's state into one zip blob, as `pack` of a save that wrote them."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, state in files.items():
            with z.open(name, "w", force_zip64=True) as f:
                torch.save(state, f)
    return buf.getbuffer()


def seal(piece: memoryview) -> memoryview:
    """Write a flat piece's CRC-32 into its prefix (a zip has its own): a pass over it, off the
    training thread (zlib lets go of the GIL)."""
    if is_flat(piece):
        at = len(MAGIC)
        struct.pack_into("<I", piece, at, zlib.crc32(piece[at + 4 :]))
    return piece


def is_flat(blob: Any) -> bool:
    return bytes(blob[: len(MAGIC)]) == MAGIC


def load(blob: Any) -> dict[str, Any]:
    """{file name: state} from a piece, once its CRC-32 matches (ValueError where it does not);
    the tensors are views of `blob`."""
    blob = memoryview(blob).cast("B")
    at = len(MAGIC)
    crc, size = _PREFIX.unpack_from(blob, at)
    if zlib.crc32(blob[at + 4 :]) != crc:
        raise ValueError("the piece is damaged (its CRC-32 does not match)")
    state, layout = pickle.loads(blob[len(blob) - size :])
    tensors = []
    for off, nbytes, dtype, shape, param, grad in layout:
        t = torch.empty(shape, dtype=dtype)
        if nbytes:  # a storage of its own over the blob, as torch.save wants each tensor's
            with warnings.catch_warnings():  # a read-only blob: the tensors are only saved
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(blob, dtype=dtype, count=t.numel(), offset=off).view(shape)
        tensors.append(torch.nn.Parameter(t, requires_grad=grad) if param else t)

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return tensors[pid[1]]

    return Unpickler(io.BytesIO(state)).load()


def write(files: Mapping[str, Any], out: str) -> None:
    """Each file's state into `out`, with torch.save, as the rank would have saved it."""
    for name, state in files.items():
        torch.save(state, os.path.join(out, name))


def whole(blob: Any) -> Callable[[str], None]:
    """The piece as a function that writes its files into a directory, once it matches the
    CRC-32 it was packed with (a pass over it); ValueError where it does not, or is not a piece
    at all any more."""
    try:
        if is_flat(blob):
            files = load(blob)
            return lambda out: write(files, out)
        z = zipfile.ZipFile(io.BytesIO(blob))
        bad = z.testzip()
    except Exception as e:  # what a damaged piece raises: BadZipFile, struct.error, pickle's
        raise ValueError(f"the piece is damaged ({type(e).__name__}: {e})") from e
    if bad is not None:
        z.close()
        raise ValueError(f"the piece is damaged ({bad} does not match its CRC-32)")

    def extract(out: str) -> None:
        with z:
            z.extractall(out)  # zipfile keeps each name inside `out`

    return extract
