"""Files over the wire: a model and its external-data files as FileHeader + FileChunk
messages, both directions. Shared by the server and the Python client.

Receiving checks everything a sender can get wrong: paths (relative, inside the folder, no
duplicates), declared sizes against the limit, contiguous offsets, complete files and their
SHA-256. A problem raises ProtocolError (the stream is malformed) or LimitExceededError.
"""
from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from graphopt.errors import LimitExceededError

from ._proto import graphopt_pb2 as pb

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_NAME_BYTES = 255        # one path component (NAME_MAX of Linux file systems)
MAX_PATH_BYTES = 1024       # a whole relative path
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ProtocolError(Exception):
    """The message stream does not follow the contract (the message names what is wrong)."""


def sha256_of(path: str | os.PathLike, block_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


def safe_relative_path(text: str) -> PurePosixPath:
    """A relative path that stays inside its folder, or ProtocolError naming the path."""
    if not text:
        raise ProtocolError("a file header has an empty path")
    if len(text.encode(errors="surrogatepass")) > MAX_PATH_BYTES:
        raise ProtocolError(f"file path {_shown(text)} is longer than {MAX_PATH_BYTES} bytes")
    if "\\" in text or "\x00" in text:
        raise ProtocolError(f"file path {text!r} must use '/' and no NUL characters")
    if PurePosixPath(text).is_absolute():
        raise ProtocolError(f"file path {text!r} is absolute; paths are relative to the model's folder")
    path = PurePosixPath(posixpath.normpath(text))   # 'a/../w.bin' is 'w.bin'
    if path == PurePosixPath(".") or path.parts[0] == "..":
        raise ProtocolError(f"file path {text!r} points outside the model's folder")
    for part in path.parts:
        if len(part.encode(errors="surrogatepass")) > MAX_NAME_BYTES:
            raise ProtocolError(f"file path {_shown(text)}: the name {_shown(part)} is longer than "
                                f"{MAX_NAME_BYTES} bytes")
    return path


def _shown(text: str, keep: int = 60) -> str:
    """A path as a message shows it: cut when long."""
    return repr(text) if len(text) <= keep else repr(text[:keep]) + f"... ({len(text)} characters)"


def file_messages(path: str | os.PathLike, relative_path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """(FileHeader, [FileChunk...]) of one file, the chunks read lazily."""
    size = os.path.getsize(path)
    header = pb.FileHeader(path=relative_path, size_bytes=size, sha256=sha256_of(path))

    def chunks() -> Iterator[pb.FileChunk]:
        offset = 0
        with open(path, "rb") as f:
            while block := f.read(chunk_bytes):
                yield pb.FileChunk(offset=offset, data=block)
                offset += len(block)
    return header, chunks()


@dataclass
class ReceivedFiles:
    folder: Path
    paths: list[str] = field(default_factory=list)   # relative, the model first
    total_bytes: int = 0

    @property
    def model_path(self) -> Path:
        return self.folder / self.paths[0]


class FileReceiver:
    """Feed it FileHeader and FileChunk messages in stream order; call finish() at the end.

    `max_total_bytes` bounds the sum of the declared sizes (checked at each header, before
    any byte of that file is written), `max_files` their number; `reserve(size_bytes, path)`,
    when given, is asked for each file's declared size first (it raises when there is no room).
    A file may not be where another file's folder is, nor the reverse."""

    def __init__(self, folder: str | os.PathLike, max_total_bytes: int | None = None, max_files: int | None = None,
                 reserve=None):
        self.result = ReceivedFiles(Path(folder))
        self.max_total_bytes = max_total_bytes
        self.max_files = max_files
        self._reserve = reserve
        self._files: set[str] = set()
        self._folders: set[str] = set()
        self._header: pb.FileHeader | None = None
        self._file = None
        self._received = 0
        self._digest = None

    def header(self, header: pb.FileHeader) -> None:
        self._close_current()
        relative = safe_relative_path(header.path)
        first = not self.result.paths
        if first and len(relative.parts) != 1:
            raise ProtocolError(f"the model's path {header.path!r} must be a plain file name")
        name = str(relative)
        if name in self._files:
            raise ProtocolError(f"file {_shown(header.path)} was sent twice")
        if name in self._folders:
            raise ProtocolError(f"file {_shown(header.path)} clashes with a folder of an earlier file's path")
        parents = [str(p) for p in relative.parents if str(p) != "."]
        for parent in parents:
            if parent in self._files:
                raise ProtocolError(f"file {_shown(header.path)} would be inside {_shown(parent)}, which is a file")
        if self.max_files is not None and len(self._files) >= self.max_files:
            raise LimitExceededError(f"the upload has more than {self.max_files} files, this server's limit")
        if header.size_bytes < 0:
            raise ProtocolError(f"file {header.path!r} declares a negative size")
        if not _HEX64.fullmatch(header.sha256):
            raise ProtocolError(f"file {header.path!r}: sha256 must be 64 lower-case hex digits")
        total = self.result.total_bytes + header.size_bytes
        if self.max_total_bytes is not None and total > self.max_total_bytes:
            raise LimitExceededError(
                f"the model's files total {total} bytes with {header.path!r}, over this server's limit "
                f"of {self.max_total_bytes} bytes")
        if self._reserve is not None:
            self._reserve(header.size_bytes, header.path)
        self.result.total_bytes = total
        target = self.result.folder / relative
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(target, "wb")
        except OSError as exc:
            raise _storage_error(exc, header.path) from None
        self._files.add(name)
        self._folders.update(parents)
        self.result.paths.append(name)
        self._header, self._received, self._digest = header, 0, hashlib.sha256()

    def chunk(self, chunk: pb.FileChunk) -> None:
        if self._header is None:
            raise ProtocolError("a chunk arrived before any file header")
        if chunk.offset != self._received:
            raise ProtocolError(f"file {self._header.path!r}: chunk at offset {chunk.offset}, expected "
                                f"{self._received} (chunks must be contiguous and in order)")
        end = self._received + len(chunk.data)
        if end > self._header.size_bytes:
            raise ProtocolError(f"file {self._header.path!r}: chunks run to byte {end}, past its declared "
                                f"size of {self._header.size_bytes} bytes")
        try:
            self._file.write(chunk.data)
        except OSError as exc:
            raise _storage_error(exc, self._header.path) from None
        self._digest.update(chunk.data)
        self._received = end

    def finish(self) -> ReceivedFiles:
        self._close_current()
        if not self.result.paths:
            raise ProtocolError("no model file was sent")
        return self.result

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _close_current(self) -> None:
        if self._header is None:
            return
        try:
            self._file.close()
        except OSError as exc:
            raise _storage_error(exc, self._header.path) from None
        finally:
            self._file = None
        header, self._header = self._header, None
        if self._received != header.size_bytes:
            raise ProtocolError(f"the stream ended after {self._received} of {header.size_bytes} bytes of "
                                f"file {header.path!r} (truncated)")
        if self._digest.hexdigest() != header.sha256:
            raise ProtocolError(f"file {header.path!r}: checksum mismatch (sent sha256 {header.sha256}, "
                                f"received data hashes to {self._digest.hexdigest()})")


def _storage_error(exc: OSError, path: str) -> Exception:
    """What a failure to store a received file means to the sender, without this side's paths."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitExceededError(f"no space left to store file {_shown(path)}: the disk is full; try again later")
    return ProtocolError(f"file {_shown(path)} cannot be stored: {exc.strerror or type(exc).__name__}")


def folder_messages(folder: Path, relative_paths: Iterable[str], chunk_bytes: int, wrap) -> Iterator:
    """Every file as wrap(header=...) then wrap(chunk=...) messages, in the given order."""
    for relative in relative_paths:
        header, chunks = file_messages(folder / relative, relative, chunk_bytes)
        yield wrap(file=header)
        for chunk in chunks:
            yield wrap(chunk=chunk)
