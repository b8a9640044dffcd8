"""Model weights from a model hub: `hf://org/name@revision` through huggingface_hub.

huggingface_hub (the optional extra `ditfleet[hub]`) does the downloading into
`<cache_dir>/hub`, in its own cache layout, with its own per-file locks and temporary names; it
honours HF_HUB_OFFLINE, HF_ENDPOINT and HF_TOKEN itself. This module adds what the worker needs:
one fetch per node at a time, only the files the loader reads, the layout check, and errors that
say what to do instead of a traceback from inside the HTTP client.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ditfleet.model.family import components_of
from ditfleet.workers.weights.node_cache import (
    REQUIRED_FILES,
    Layout,
    ModelFetchError,
    check_layout,
    node_lock,
    relative_files,
)

# The folders a diffusers-layout model may hold that the loader reads; anything else in the repo
# (other formats, samples, a second copy of the weights) is never downloaded.
_FOLDERS = (*REQUIRED_FILES, "text_encoder", "tokenizer")
_ALLOW = ["model_index.json", *[f"{folder}/*" for folder in _FOLDERS]]
_IGNORE = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.msgpack", "*.h5", "*.onnx", "*.onnx_data"]


@dataclass(frozen=True)
class HubSnapshot:
    path: Path  # the snapshot folder (files are links into the hub cache's blobs)
    revision: str  # the commit the revision resolved to
    downloaded_bytes: int  # bytes that arrived during this call
    files: int
    lock_wait_s: float


def parse_hub_source(source: str) -> tuple[str, str]:
    """'hf://org/name@revision' -> ('org/name', 'revision'); the revision defaults to 'main'."""
    rest = source.removeprefix("hf://")
    repo_id, _, revision = rest.partition("@")
    if not repo_id or repo_id.count("/") > 1 or repo_id.startswith("/") or repo_id.endswith("/"):
        raise ModelFetchError(
            f"model path {source!r}: write a hub model as hf://org/name or hf://org/name@revision"
        )
    return repo_id, revision or "main"


def fetch_hub_snapshot(
    source: str, cache_dir: Path, lock_timeout_s: float, layout: Layout | None = None
) -> HubSnapshot:
    """The snapshot of `source` in the node's hub cache: a diffusers-layout model, or a folder
    of `layout` (a scorer's model)."""
    repo_id, revision = parse_hub_source(source)
    try:
        import huggingface_hub
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        raise ModelFetchError(
            f"{source}: hf:// model paths need huggingface_hub on every node: pip install "
            "'ditfleet[hub]' (or stage the weights in a bucket and use s3://bucket/prefix)"
        ) from None

    hub_cache = Path(cache_dir).absolute() / "hub"
    storage = hub_cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    # The hub locks per file; this lock makes the other actors of the node wait for the whole
    # snapshot instead of racing through it file by file.
    lock_path = hub_cache / f"{storage.name}-{hashlib.sha256(revision.encode()).hexdigest()[:16]}.lock"
    try:
        with node_lock(lock_path, lock_timeout_s, f"{source} into {hub_cache}") as waited:
            before = _blob_bytes(storage)
            allowed = _ALLOW if layout is not None else _allow_for_index(repo_id, revision, hub_cache)
            path = Path(
                huggingface_hub.snapshot_download(
                    repo_id,
                    revision=revision,
                    cache_dir=hub_cache,
                    allow_patterns=list(layout.allow) if layout is not None else allowed,
                    ignore_patterns=_IGNORE,
                )
            )
            downloaded = max(0, _blob_bytes(storage) - before)
    except ModelFetchError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes an error that says what to do
        raise _hub_error(e, source, repo_id, revision, hub_cache) from None

    files = sorted(relative_files(path))
    hint = f"point at a repository or revision in the diffusers layout (folders {', '.join(_FOLDERS)})"
    check_layout(set(files), f"{source} ({path})", hint, layout)
    return HubSnapshot(path, path.name, downloaded, len(files), waited)


def _allow_for_index(repo_id: str, revision: str, hub_cache: Path) -> list[str]:
    """What a snapshot of a diffusers-layout repository fetches: model_index.json and the folders
    the loader reads, plus every component folder model_index.json names (text_encoder_2,
    tokenizer_3, ... of a pipeline run through diffusers)."""
    import huggingface_hub
    import huggingface_hub.errors

    try:
        index_path = huggingface_hub.hf_hub_download(
            repo_id, "model_index.json", revision=revision, cache_dir=hub_cache
        )
    except huggingface_hub.errors.EntryNotFoundError:
        return _ALLOW  # a hand-assembled folder without one: the loader's own folders
    try:
        index = json.loads(Path(index_path).read_text())
    except (OSError, ValueError):
        return _ALLOW  # the loader says what is wrong with it
    extra = [f"{name}/*" for name in sorted(components_of(index) if isinstance(index, dict) else {})]
    return list(dict.fromkeys([*_ALLOW, *extra]))


def read_hub_index(source: str, cache_dirs: Sequence[Path] = ()) -> tuple[dict | None, str | None]:
    """(the model_index.json of the hub model `source`, None and why not): from a hub cache (the
    user's default one, then each of `cache_dirs`' hub/ folder, as the nodes fill it), else that
    one small file fetched from the hub (not under HF_HUB_OFFLINE). The driver reads it before
    any work (jobs.spec), so the checkpoint's family is known and an unrunnable one refused there."""
    repo_id, revision = parse_hub_source(source)
    try:
        import huggingface_hub
    except ImportError:
        return (
            None,
            f"{source}: huggingface_hub is not installed here (pip install 'ditfleet[hub]'), so model_index.json was not read",
        )
    caches = [None, *(Path(c).absolute() / "hub" for c in cache_dirs)]
    for cache in caches:
        try:
            found = huggingface_hub.try_to_load_from_cache(
                repo_id, "model_index.json", cache_dir=cache, revision=revision
            )
        except Exception:  # noqa: BLE001 - a malformed cache is one without the file
            found = None
        if isinstance(found, str):
            return _json_index(Path(found), source)
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None, f"{source}: HF_HUB_OFFLINE is set and model_index.json is in no hub cache here"
    try:
        path = huggingface_hub.hf_hub_download(
            repo_id, "model_index.json", revision=revision, etag_timeout=10
        )
    except Exception as e:  # noqa: BLE001 - every failure becomes a note or an error saying what to do
        error = _hub_error(e, source, repo_id, revision, Path(huggingface_hub.constants.HF_HUB_CACHE))
        if isinstance(e, huggingface_hub.errors.EntryNotFoundError):
            return (
                None,
                f"{source}: has no model_index.json (a diffusers checkpoint names its pipeline class there)",
            )
        return None, str(error)
    return _json_index(Path(path), source)


def _json_index(path: Path, source: str) -> tuple[dict | None, str | None]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{source}: model_index.json is not readable JSON ({e})"
    return (
        (index, None) if isinstance(index, dict) else (None, f"{source}: model_index.json is not an object")
    )


def _hub_error(e: Exception, source: str, repo_id: str, revision: str, hub_cache: Path) -> ModelFetchError:
    """What a failed snapshot download means for the user, and what to do about it."""
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, LocalEntryNotFoundError):
        if huggingface_hub.constants.HF_HUB_OFFLINE:  # huggingface_hub reads HF_HUB_OFFLINE
            return ModelFetchError(
                f"{source}: HF_HUB_OFFLINE is set and revision {revision!r} of {repo_id} is not (completely) "
                f"in the hub cache {hub_cache}. Pre-populate it on this node (HF_HUB_CACHE={hub_cache} hf "
                f"download {repo_id} --revision {revision}), unset HF_HUB_OFFLINE, or stage the weights "
                "in a bucket (s3://)"
            )
        cause = e.__cause__ or e
        return ModelFetchError(
            f"{source}: the model hub cannot be reached ({type(cause).__name__}: {cause}) and revision "
            f"{revision!r} is not in the hub cache {hub_cache}. Check the network and HF_ENDPOINT, or set "
            "HF_HUB_OFFLINE=1 with a pre-populated cache, or stage the weights in a bucket (s3://) the "
            "nodes can reach"
        )
    if isinstance(e, RevisionNotFoundError):
        return ModelFetchError(
            f"{source}: {repo_id} has no revision {revision!r}; give a branch, tag or commit that exists"
        )
    if isinstance(e, (RepositoryNotFoundError, GatedRepoError)):
        return ModelFetchError(
            f"{source}: {repo_id} was not found or may not be read with these credentials; check the "
            "name, and for a private or gated repository accept its terms and set HF_TOKEN on every node"
        )
    if isinstance(e, HfHubHTTPError):
        return ModelFetchError(f"{source}: the model hub answered {e}; try again later")
    if isinstance(e, HFValidationError):
        return ModelFetchError(f"model path {source!r}: {e}; write hf://org/name@revision")
    if isinstance(e, (ConnectionError, TimeoutError)):
        return ModelFetchError(
            f"{source}: the connection to the model hub failed ({e}); start again (files already "
            "downloaded are kept)"
        )
    if isinstance(e, OSError):
        return ModelFetchError(
            f"{source}: cannot write the hub cache {hub_cache} ({e.strerror or e}); give a writable "
            "node-local cache directory with room for the model"
        )
    # e.g. the HTTP client's own errors mid-download
    return ModelFetchError(
        f"{source}: fetching from the model hub failed ({type(e).__name__}: {e}); start again "
        "(files already downloaded are kept)"
    )


def _blob_bytes(storage: Path) -> int:
    """Bytes in the repository's blob store: what grew is what was downloaded."""
    blobs = storage / "blobs"
    if not blobs.is_dir():
        return 0
    return sum(entry.stat().st_size for entry in os.scandir(blobs) if entry.is_file())
