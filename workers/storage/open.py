"""Opening the store an output URI names: a local directory or an S3 bucket prefix."""

from __future__ import annotations

from urllib.parse import urlparse

from ditfleet.workers.storage.base import ObjectStore, S3Config
from ditfleet.workers.storage.input_files import check_s3_uri
from ditfleet.workers.storage.local import LocalStore


def open_store(uri: str, config: S3Config | None = None) -> ObjectStore:
    """Open the store an output URI names: "/path", "relative/path", "file:///path" or
    "s3://bucket[/prefix]". `config` applies to s3:// only."""
    check_s3_uri(uri, "store")
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"{uri!r}: a file:// URI must name a local path (file:///path)")
            path = parsed.path
        else:
            path = uri
        if not path:
            raise ValueError("an empty path is not an output location")
        return LocalStore(path)
    if parsed.scheme == "s3":
        from ditfleet.workers.storage.s3 import S3Store

        if not parsed.netloc:
            raise ValueError(f"{uri!r}: an s3 URI needs a bucket: s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.lstrip("/"), config or S3Config())
    raise ValueError(f"{uri!r}: unsupported scheme {parsed.scheme!r}; use a path, file:// or s3://")
