"""Where input and output may be: checked before anything is read, written or started.

- An output inside the input directory (or prefix) would be read back as input: its manifests
  are Parquet files. Refused for plain and incremental jobs alike.
- `#` and `?` in an s3:// URI: URL parsing reads them as a fragment or query and cuts the key
  there (workers.storage.input_files.check_s3_uri).
- A local path inside a Ray job's working_dir package (`.../runtime_resources/working_dir_files/
  _ray_pkg_*/`): `ray job submit --working-dir .` runs the job there, so a relative path in the
  job file lands in a temporary folder that no user looks into and Ray deletes.
- A local output on a cluster of several nodes: each node would write images and manifests to
  its own disk, so resume and `_SUCCESS` would be wrong. Allowed only when the path is declared a
  shared filesystem (`output.shared_filesystem: true`: NFS, EFS, Lustre mounted at the same path
  on every node).
"""

from __future__ import annotations

import os

from ditfleet.driver.input.prompts import glob_start
from ditfleet.workers.storage.input_files import check_s3_uri, is_s3

_RAY_PKG_PARENT = "working_dir_files"
_RAY_PKG_PREFIX = "_ray_pkg_"
_USE_SHARED = (
    "use an s3:// URI, or an absolute path on a filesystem that every node mounts at the same "
    "place (then set output.shared_filesystem: true)"
)


class LocationError(ValueError):
    """An input or output location that cannot work; the message says which and what to do."""


def _local_dir(uri: str) -> str:
    """The directory a local input names: the path itself, or where a glob starts."""
    parts = os.path.abspath(uri).split(os.sep)
    base = os.sep.join(parts[: glob_start(parts)])
    return os.path.realpath(base or os.sep)


def _s3_prefix(uri: str) -> str:
    parts = uri[len("s3://") :].split("/")
    return "/".join(parts[: glob_start(parts)]).rstrip("/")


def _inside(child: str, parent: str, sep: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(sep) + sep)


def check_output_is_a_folder(output_uri: str) -> None:
    """Refuse a local output that is a file, or lies under one (it would fail on the first write)."""
    if is_s3(output_uri):
        return
    path = os.path.abspath(output_uri.removeprefix("file://"))
    probe = path
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == path else f"lies under {probe}, which is a file"
        raise LocationError(
            f"output {output_uri} {where}, not a folder: give output.uri a folder (created if missing)"
        )


def check_output_outside_input(input_uri: str, output_uri: str) -> None:
    """Refuse an output that is the input directory or lies inside it (or the same on S3)."""
    if is_s3(input_uri) != is_s3(output_uri):
        return
    if is_s3(input_uri):
        inside = _inside(_s3_prefix(output_uri), _s3_prefix(input_uri), "/")
    else:
        if os.path.isfile(input_uri):  # one file: nothing else in its directory is read
            return
        inside = _inside(os.path.realpath(os.path.abspath(output_uri)), _local_dir(input_uri), os.sep)
    if inside:
        raise LocationError(
            f"the output {output_uri} is inside the input {input_uri}: the output's manifests (Parquet) "
            "would be read back as prompts. Put the output somewhere else, e.g. next to the input "
            "directory, not in it"
        )


def ray_working_dir_package(path: str) -> str | None:
    """The `_ray_pkg_*` folder `path` lies in (a Ray job's unpacked working_dir), else None."""
    parts = os.path.realpath(os.path.abspath(path)).split(os.sep)
    for i in range(1, len(parts)):
        if parts[i].startswith(_RAY_PKG_PREFIX) and parts[i - 1] == _RAY_PKG_PARENT:
            return os.sep.join(parts[: i + 1])
    return None


def check_not_in_ray_package(what: str, uri: str) -> None:
    """Refuse a local input or output that resolves inside a Ray job's working_dir package."""
    if is_s3(uri):
        return
    package = ray_working_dir_package(uri)
    if package is not None:
        raise LocationError(
            f"the {what} {uri} is inside the Ray job's working_dir package {package}: the job runs "
            "there (ray job submit --working-dir), so a relative path lands in a temporary folder "
            f"that Ray deletes and no other node has. For the {what}, {_USE_SHARED}"
        )


def check_local_output_nodes(output_uri: str, shared_filesystem: bool, alive_nodes: int) -> None:
    """Refuse a local output on a cluster of more than one node unless declared shared."""
    if is_s3(output_uri) or shared_filesystem or alive_nodes <= 1:
        return
    raise LocationError(
        f"the output {output_uri} is a local path, and this Ray cluster has {alive_nodes} nodes: each "
        "node would write images and manifests to its own disk, so resume and _SUCCESS would be "
        f"wrong. For the output, {_USE_SHARED}"
    )


def check_locations(input_uri: str, output_uri: str) -> None:
    """Every check that needs no cluster: URIs, output inside input, Ray package folders."""
    try:
        check_s3_uri(input_uri, "input")
        check_s3_uri(output_uri, "output")
    except ValueError as e:
        raise LocationError(str(e)) from None
    check_not_in_ray_package("input", input_uri)
    check_not_in_ray_package("output", output_uri)
    check_output_outside_input(input_uri, output_uri)
    check_output_is_a_folder(output_uri)
