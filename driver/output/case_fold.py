"""Ids that differ only in case, on an output whose store folds case.

A macOS or Windows volume, or an SMB share of one, keeps "Cat.png" and "cat.png" as one file: in
the "files" format, where an image's key is its id (workers.output.layout.image_key), the rows
"Cat" and "cat" of one shard would write one object, the second image replacing the first while
both rows commit and name it. The key layout stays as it is; such an output refuses such ids
instead, before anything of the job is written: `refuse_ids_that_fold` probes the store once when
the output is claimed (a probe object whose other-case name resolves), and on a store that folds
reads the input's id columns again and names every row whose id another row's equals once ASCII
letters are lowered (exit 2). Any two such rows are refused, not only two of one shard: which
rows share a shard depends on `shards.size`, and a later run with another size must not collide.

Cost: the probe is one write, one existence check and one delete (a store that does not fold
pays only this); a folding store also reads the id columns once more (bench/derived_checks.py).
"""

from __future__ import annotations

import uuid

from ditfleet.driver.input.duplicate_ids import DuplicateIds
from ditfleet.driver.input.prompts import PromptSource, iter_batches
from ditfleet.driver.input.row_errors import InputError
from ditfleet.workers.output.formats import FORMATS
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import PROBE_PREFIX

# The output formats whose objects are named by ids; the others hold many images per object.
ID_NAMED_FORMATS = tuple(f.name for f in FORMATS if f.objects.per_image)
_MAX_ERRORS = 20


def store_folds_case(store: ObjectStore) -> bool:
    """Whether `store` resolves a key in another case to the same object: a probe object is
    written under a mixed-case key, the lower-case key looked up, and the probe deleted."""
    token = uuid.uuid4().hex
    probe = f"{PROBE_PREFIX}case-probe-{token}-ABC"
    store.put(probe, b"case probe")
    try:
        return store.exists(probe.lower())
    finally:
        store.delete(probe)


def refuse_ids_that_fold(
    store: ObjectStore, source: PromptSource, rows: RowConfig, output_format: str
) -> None:
    """Raise InputError naming the rows whose ids differ only in case, when the output names its
    objects by id and its store folds case (see the module docstring); nothing otherwise."""
    if output_format not in ID_NAMED_FORMATS or not store_folds_case(store):
        return
    files = []
    for file in source.files():
        parquet = source.open(file)
        files.append((file.uri, parquet, rows.id_column in parquet.schema_arrow.names))
    ids = DuplicateIds(
        sum(p.metadata.num_rows for _, p, _ in files), id_column=rows.id_column, fold_case=True
    )
    start = 0
    for uri, parquet, has_ids in files:
        n = parquet.metadata.num_rows
        ids.add_file(start, n, uri, has_ids)
        if not has_ids:  # ids are positions: digits, nothing to fold
            ids.add_positions(start, n)
        else:
            for first_row, batch in iter_batches(parquet, [rows.id_column]):
                ids.add_ids(batch.column(rows.id_column), start + first_row)
        start += n
    total, errors = ids.count_and_errors(source, _MAX_ERRORS)
    if total:
        raise InputError(errors, total)
