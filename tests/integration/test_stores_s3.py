"""The object-store contract of tests/unit/workers/test_stores.py, run on S3 (a real moto HTTP
server): the same test functions, with this module's `store`."""

from __future__ import annotations

import pytest

from ditfleet.workers.storage import ObjectStore, open_store
from tests.unit.workers.test_stores import (  # noqa: F401  (collected here, against S3)
    test_a_conditional_replace_writes_only_over_the_version_it_read,
    test_check_writable_passes_and_leaves_nothing,
    test_copy_and_move_are_create_only_and_resumable,
    test_list_is_paginated_and_complete,
    test_put_file_streams_from_the_current_position,
    test_put_get_exists_list_delete,
    test_put_if_absent_first_writer_wins,
    test_put_if_absent_race_has_one_winner,
    test_uri,
)


@pytest.fixture
def store(s3_server, s3_bucket) -> ObjectStore:
    # Small LIST pages so that listing 120 keys takes three requests.
    return open_store(f"s3://{s3_bucket}/runs/one", s3_server.config(list_page_size=50))
