"""Object stores behind one small blocking interface (the engine calls it from a thread pool).

``file://DIR`` (embedded default, atomic publish by rename), ``mem://`` (tests) and
``s3://bucket/prefix`` (boto3, see s3.py) all implement ObjectStore.
"""
from __future__ import annotations

import abc
import os
import threading
import uuid
from urllib.parse import urlsplit


class ObjectStoreError(Exception):
    """The store failed an operation (network, throttling, missing object...)."""


class ObjectNotFound(ObjectStoreError):
    """The key does not exist."""


class ObjectStore(abc.ABC):
    """put / ranged get / delete / list of opaque objects; all calls block."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store the whole object; readers never see a partial object."""

    @abc.abstractmethod
    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object (end None = to the end)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Object length in bytes."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete objects; missing keys are not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with prefix."""

    def close(self) -> None:
        """Release clients/connections."""


class FileObjectStore(ObjectStore):
    """Objects as files under a directory; put writes a temp file, fsyncs, then renames."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ObjectStoreError(f"bad key {key!r}")
        return os.path.join(self.root, key)

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise ObjectStoreError(str(e)) from e

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(-1 if end is None else max(end - start, 0))
        except FileNotFoundError as e:
            raise ObjectNotFound(key) from e
        except OSError as e:
            raise ObjectStoreError(str(e)) from e

    def size(self, key: str) -> int:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError as e:
            raise ObjectNotFound(key) from e

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass

    def list(self, prefix: str = "") -> list[str]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if ".tmp-" in name:
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


class MemObjectStore(ObjectStore):
    """A dict; ``mem://name`` stores of the same name share contents within one process."""

    _shared: dict[str, dict[str, bytes]] = {}

    def __init__(self, name: str = "") -> None:
        self.url = "mem://" + name
        self._lock = threading.Lock()
        self.objects = self._shared.setdefault(name, {}) if name else {}

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self.objects[key] = bytes(data)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with self._lock:
            try:
                data = self.objects[key]
            except KeyError as e:
                raise ObjectNotFound(key) from e
        return data[start:end]

    def size(self, key: str) -> int:
        with self._lock:
            try:
                return len(self.objects[key])
            except KeyError as e:
                raise ObjectNotFound(key) from e

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self.objects.pop(k, None)

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self.objects if k.startswith(prefix))


def open_object_store(url: str) -> ObjectStore:
    """Build a store from ``file://DIR``, ``mem://[name]`` or ``s3://bucket/prefix?...``."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return FileObjectStore(parts.netloc + parts.path if parts.netloc not in ("", "localhost")
                               else parts.path)
    if parts.scheme == "mem":
        return MemObjectStore(parts.netloc + parts.path)
    if parts.scheme == "s3":
        from .s3 import S3ObjectStore
        return S3ObjectStore(url)
    if parts.scheme == "" and url:
        return FileObjectStore(url)
    raise ValueError(f"unsupported object store URL {url!r}")
