"""Files over the wire: a model and its external-data files as FileHeader + FileChunk
messages, both directions. Shared by the server and the Python client.

Receiving checks everything a sender can get wrong: paths (relative, inside the folder, no
duplicates), declared sizes against the limit, contiguous offsets, complete files and their
SHA-256. A problem raises ProtocolError (the stream is malformed) or LimitExceededError.
"""
from __future__ import annotations

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
    if "\\" in text or "\x00" in text:
        raise ProtocolError(f"file path {text!r} must use '/' and no NUL characters")
    if PurePosixPath(text).is_absolute():
        raise ProtocolError(f"file path {text!r} is absolute; paths are relative to the model's folder")
    path = PurePosixPath(posixpath.normpath(text))   # 'a/../w.bin' is 'w.bin'
    if path == PurePosixPath(".") or path.parts[0] == "..":
        raise ProtocolError(f"file path {text!r} points outside the model's folder")
    return path


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
    any byte of that file is written)."""

    def __init__(self, folder: str | os.PathLike, max_total_bytes: int | None = None):
        self.result = ReceivedFiles(Path(folder))
        self.max_total_bytes = max_total_bytes
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
        if str(relative) in self.result.paths:
            raise ProtocolError(f"file {header.path!r} was sent twice")
        if header.size_bytes < 0:
            raise ProtocolError(f"file {header.path!r} declares a negative size")
        if not _HEX64.fullmatch(header.sha256):
            raise ProtocolError(f"file {header.path!r}: sha256 must be 64 lower-case hex digits")
        total = self.result.total_bytes + header.size_bytes
        if self.max_total_bytes is not None and total > self.max_total_bytes:
            raise LimitExceededError(
                f"the model's files total {total} bytes with {header.path!r}, over this server's limit "
                f"of {self.max_total_bytes} bytes")
        self.result.total_bytes = total
        target = self.result.folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        self.result.paths.append(str(relative))
        self._header, self._received, self._digest = header, 0, hashlib.sha256()
        self._file = open(target, "wb")

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
        self._file.write(chunk.data)
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
        self._file.close()
        self._file = None
        header, self._header = self._header, None
        if self._received != header.size_bytes:
            raise ProtocolError(f"the stream ended after {self._received} of {header.size_bytes} bytes of "
                                f"file {header.path!r} (truncated)")
        if self._digest.hexdigest() != header.sha256:
            raise ProtocolError(f"file {header.path!r}: checksum mismatch (sent sha256 {header.sha256}, "
                                f"received data hashes to {self._digest.hexdigest()})")


def folder_messages(folder: Path, relative_paths: Iterable[str], chunk_bytes: int, wrap) -> Iterator:
    """Every file as wrap(header=...) then wrap(chunk=...) messages, in the given order."""
    for relative in relative_paths:
        header, chunks = file_messages(folder / relative, relative, chunk_bytes)
        yield wrap(file=header)
        for chunk in chunks:
            yield wrap(chunk=chunk)
