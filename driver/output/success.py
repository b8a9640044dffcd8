"""`_SUCCESS` is valid only under the lease generation that wrote it.

It holds the job summary (driver.output.summary) and "lease": the generation of the driver that
wrote it, create-only, right after checking its lease; one of a lower generation is replaced.
A `_SUCCESS` is stale when a lease document of a higher generation is present whose holder may
change the output (a driver; not a tool that leaves a complete output complete, `ditfleet compact`
or `verify --clean`, whose lease says "keeps_complete"): `success_file` (and every tool reading
`_SUCCESS` through it: resume, status, verify, report) treats it as absent and says so in one
line. So a driver paused past its lease that resumes and writes `_SUCCESS` writes at worst a
stale one, which nothing of ours believes. Only a driver deletes lease documents, those below its
own, which is then the highest (driver.output.settle), so staleness, once true, stays true. A
`_SUCCESS` without "lease" was written by an earlier version (which kept only the highest lease
document) and counts as written by that document's driver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ditfleet.driver.output.json_objects import read_json
from ditfleet.driver.output.lease import OutputBusy, OutputLease, lease_generations, read_lease_document
from ditfleet.driver.output.pause_points import pause_point
from ditfleet.workers.output.layout import success_key
from ditfleet.workers.storage import ObjectNotFound, ObjectStore

_TRIES = 5  # replacements of `_SUCCESS` lost to other writers before giving up


class SuccessStale(OutputBusy):
    """A higher lease generation than this driver's wrote `_SUCCESS`: this driver lost the output."""


def _lease_of(doc: dict[str, Any] | None) -> int | None:
    value = (doc or {}).get("lease")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _keeps_complete(store: ObjectStore, generation: int) -> bool:
    """The lease of `generation` was taken by a tool that leaves a complete output complete. A
    document that cannot be read counts as a driver's: then `_SUCCESS` is not believed."""
    doc = read_lease_document(store, generation)
    return bool(doc and doc.get("keeps_complete") is True)


def _read_success(store: ObjectStore) -> tuple[bytes, int | None] | None:
    """`_SUCCESS`'s bytes and the lease generation they were written under; None when absent."""
    try:
        data = store.get(success_key())
    except ObjectNotFound:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None  # not JSON: nothing to keep
    return data, _lease_of(doc if isinstance(doc, dict) else None)


def put_success(store: ObjectStore, doc: dict[str, Any], lease: int | None) -> None:
    """Write `doc` as `_SUCCESS`, stamped "lease": `lease`, create-only; one of a lower (or no)
    generation there is removed first, only if it is still the one read (delete_if_holds), so a
    driver paused in between never replaces a later generation's. Raises SuccessStale when one
    of a higher generation is there."""
    data = (json.dumps({**doc, "lease": lease}, indent=2, default=str) + "\n").encode()
    for _ in range(_TRIES):
        if store.put_if_absent(success_key(), data, "application/json"):
            return
        found = _read_success(store)
        if found is None:
            continue  # removed meanwhile: create it
        there, wrote = found
        if wrote is not None and lease is not None and wrote > lease:
            raise SuccessStale(
                f"{store.uri(success_key())} was written by lease generation {wrote}, this driver holds "
                f"{lease}: another driver took the output"
            )
        store.delete_if_holds(success_key(), there)
    raise SuccessStale(
        f"{store.uri(success_key())} changed under this driver {_TRIES} times in a row: another driver "
        "writes the output"
    )


def remove_success(store: ObjectStore, lease: OutputLease | None) -> bool:
    """Remove `_SUCCESS` before this driver (holding `lease`; None: tests without a driver)
    changes the output; True when it did. Raises OutputBusy once the driver lost the output: it
    then removes nothing. A `_SUCCESS` of this driver's generation or a later one is kept, and
    the removal is conditional on the bytes read (delete_if_holds), so one written after the
    read stays."""
    pause_point("before_success_removal")
    if lease is not None:
        lease.check()
    found = _read_success(store)
    if found is None:
        return False
    there, wrote = found
    if lease is not None and wrote is not None and wrote >= lease.generation:
        return False
    return store.delete_if_holds(success_key(), there)


@dataclass(frozen=True)
class SuccessFile:
    """What `_SUCCESS` says to a reader: its document (None when absent or stale) and, when
    stale, the one line saying why it is not believed."""

    doc: dict[str, Any] | None
    stale: str | None = None


def success_file(store: ObjectStore, holder: int | None = None) -> SuccessFile:
    """`_SUCCESS` as every tool reads it: absent, valid, or stale. holder: the caller's own lease
    generation, not counted, so a driver that just took the lease sees the output as it was
    before. Raises ValueError when `_SUCCESS` is not JSON."""
    doc = read_json(store, success_key())
    if doc is None:
        return SuccessFile(None)
    wrote = _lease_of(doc)
    if wrote is None:
        return SuccessFile(doc)
    higher = [
        g for g in lease_generations(store) if g > wrote and g != holder and not _keeps_complete(store, g)
    ]
    if not higher:
        return SuccessFile(doc)
    return SuccessFile(
        None,
        f"_SUCCESS was written by lease generation {wrote}, but generation {higher[-1]} has taken the "
        "output since: stale; the run that owns the output writes a new one",
    )
