"""The model identified by the bytes of its weights, not by its path or its headers.

A model at the same path can be replaced by other values with the same shapes (a re-trained
checkpoint copied over the old one): the path and the safetensors headers stay the same, the
images do not. So the plan records, and every actor checks, a digest of the files' contents:

- a local directory (the driver's, or the node's copy an actor loads): sha256 of every file
  (safetensors, configs, tokenizer files), computed once per node and cached next to the node's
  model cache (`{cache_dir}/digests/`), keyed by the directory and each file's size, mtime and
  inode, so a changed file is hashed again and an unchanged one never;
- `s3://`: the objects' ETags and sizes (workers.weights.node_cache.content_revision), which
  identify the bytes: a fetched copy is verified against them (workers.weights.download);
- `hf://org/name@revision`: no digest here; a pinned commit identifies the bytes, and the path
  (in the plan) names it.

The LoRA files and the scheduler config a job names next to the model change the images as its
weights do, so their identities join the model's files (job_file_identities).

`ModelIdentity.digest` is one hex string over the per-file ones, so two identities are equal
exactly when every file is; `changed_files` says which file differs, for the refusal message.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ditfleet.model.family import PUBLISHED_SCHEME, published_file

_CHUNK = 8 * 1024 * 1024
_CACHE_VERSION = 1


class WeightsChanged(ValueError):
    """The weights an actor found are not the ones the plan recorded."""


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies a model's bytes: `kind` ("sha256" of local files, "etag" of S3 objects),
    the per-file identities (relative path -> hex digest or ETag:size) and their digest."""

    kind: str
    files: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        items = sorted(self.files.items())
        return hashlib.sha256(json.dumps([self.kind, items], separators=(",", ":")).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "files": dict(sorted(self.files.items()))}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ModelIdentity:
        return cls(str(doc.get("kind")), {str(k): str(v) for k, v in (doc.get("files") or {}).items()})


# Keys of the files a job names next to the model (job_file_identities), which say what they are.
_LORA = "LoRA {index} {path}"
_SCHEDULER = "scheduler config {path}"
_JOB_FILE_PREFIXES = ("LoRA ", "scheduler config ")


def changed_files(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """'transformer/diffusion_pytorch_model.safetensors changed (sha256 1234abcd... -> 5678ef01...)',
    '... was added', '... was removed', in path order."""
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        name = path if path.startswith(_JOB_FILE_PREFIXES) else f"model file {path}"
        if a is None:
            out.append(f"{name} was added")
        elif b is None:
            out.append(f"{name} was removed")
        else:
            out.append(f"{name} changed ({a[:16]}... -> {b[:16]}...)")
    return out


def _model_files(root: Path) -> list[Path]:
    """Every regular file of the model that a load can read (hidden files, e.g. caches, left out)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                files.append(Path(dirpath) / name)
    return files


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cache_path(cache_dir: Path, root: Path) -> Path:
    return cache_dir / "digests" / f"{hashlib.sha256(str(root).encode()).hexdigest()[:24]}.json"


def _read_cache(path: Path, root: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != _CACHE_VERSION or doc.get("root") != str(root):
        return {}
    files = doc.get("files")
    return files if isinstance(files, dict) else {}


def _write_cache(path: Path, root: Path, files: dict[str, Any]) -> None:
    # Written beside and renamed: two actors of a node computing at once leave one whole file.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digest-")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _CACHE_VERSION, "root": str(root), "files": files}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written only costs hashing again next time


def local_identity(root: str | Path, cache_dir: str | Path | None = None) -> ModelIdentity:
    """The sha256 of every file of the model directory `root`, each hashed once per node while
    its size, mtime and inode stay the same (the cache in `cache_dir`, when given)."""
    root = Path(root).resolve()
    cache = _cache_path(Path(cache_dir), root) if cache_dir is not None else None
    known = _read_cache(cache, root) if cache is not None else {}
    files: dict[str, Any] = {}
    fresh = False
    for path in _model_files(root):
        rel = path.relative_to(root).as_posix()
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = known.get(rel)
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            files[rel] = entry
            continue
        files[rel] = {"stamp": stamp, "sha256": _sha256_file(path)}
        fresh = True
    if cache is not None and (fresh or set(files) != set(known)):
        _write_cache(cache, root, files)
    return ModelIdentity("sha256", {rel: e["sha256"] for rel, e in files.items()})


def check_identity(expected: Mapping[str, Any] | None, found: ModelIdentity, where: str) -> None:
    """Refuse (WeightsChanged, naming the files) weights other than the plan's; None: no record."""
    if not expected:
        return
    want = ModelIdentity.from_dict(expected)
    if want.kind == found.kind and want.digest == found.digest:
        return
    if want.kind != found.kind:
        detail = [f"the plan identifies the model by {want.kind}, this copy by {found.kind}"]
    else:
        detail = changed_files(want.files, found.files)
    raise WeightsChanged(
        f"the model at {where} is not the one this job was planned with: {'; '.join(detail[:5])}. "
        "An output holds images of one model: restore those weights, or run the job to a new output"
    )


def etag_identity(files: Any) -> ModelIdentity:
    """The identity of a remote model from its listing (node_cache.RemoteFile: path, etag, size)."""
    return ModelIdentity("etag", {f.path: f"{f.etag}:{f.size}" for f in files})


def _job_file_identity(source: str, s3: Any) -> str:
    """One file a job names: 'sha256:<hex>' of a local file, 'etag:<etag>:<size>' of an S3
    object (one HEAD; a node's fetched copy is verified against that ETag)."""
    parsed = urlparse(source)
    if parsed.scheme == "s3":
        from ditfleet.workers.storage.s3 import make_s3_client

        head = make_s3_client(s3).head_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
        return f"etag:{str(head['ETag']).strip(chr(34))}:{head['ContentLength']}"
    if parsed.scheme == PUBLISHED_SCHEME:  # the same bytes on every node of one ditfleet version
        return f"sha256:{_sha256_file(published_file(source))}"
    path = Path(parsed.path if parsed.scheme == "file" else source)
    if path.is_dir():  # a scheduler folder: its scheduler_config.json is what is read
        path = path / "scheduler_config.json"
    return f"sha256:{_sha256_file(path)}"


def job_file_identities(loras: Any, scheduler_config: str | None, s3: Any) -> dict[str, str]:
    """The identities of the LoRA files (LoraSpec: path, scale) and the scheduler config a job
    names next to its model, keyed 'LoRA <i> <path>' and 'scheduler config <path>': they change
    the images as the weights do, so the model's identity covers them (with_job_files)."""
    out = {_LORA.format(index=i, path=a.path): _job_file_identity(a.path, s3) for i, a in enumerate(loras)}
    if scheduler_config:
        out[_SCHEDULER.format(path=scheduler_config)] = _job_file_identity(scheduler_config, s3)
    return out


def with_job_files(identity: ModelIdentity, job_files: Mapping[str, str]) -> ModelIdentity:
    """The model's identity with the files the job names next to it (job_file_identities)."""
    return ModelIdentity(identity.kind, {**identity.files, **job_files})


def model_identity(
    source: str, cache_dir: str | Path | None, s3: Any, loras: Any = (), scheduler_config: str | None = None
) -> ModelIdentity | None:
    """The identity of the model a job names, as the driver sees it: a local directory's file
    digests, an s3:// model's ETags (one listing, nothing downloaded), and the LoRA files and
    scheduler config it names (job_file_identities); None for hf:// (its pinned revision, in the
    path, identifies the bytes; its adapters are then not covered)."""
    base = _base_identity(source, cache_dir, s3)
    return None if base is None else with_job_files(base, job_file_identities(loras, scheduler_config, s3))


def _base_identity(source: str, cache_dir: str | Path | None, s3: Any) -> ModelIdentity | None:
    parsed = urlparse(source)
    if parsed.scheme == "hf":
        return None
    if parsed.scheme == "s3":
        from ditfleet.workers.storage.s3 import make_s3_client
        from ditfleet.workers.weights.download import list_s3_model

        bucket, prefix = parsed.netloc, parsed.path.strip("/")
        uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        client = make_s3_client(s3)
        endpoint = s3.endpoint_url or str(client.meta.endpoint_url)
        return etag_identity(list_s3_model(client, bucket, prefix, uri, endpoint, s3.list_page_size))
    from ditfleet.model.family import resolve_model_dir

    path = parsed.path if parsed.scheme == "file" else source
    return local_identity(resolve_model_dir(path), cache_dir)
