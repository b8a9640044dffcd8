"""The output layout and safe key components: hostile ids stay inside the output root."""

from __future__ import annotations

import itertools

import pytest

from ditfleet.workers.output import layout
from ditfleet.workers.output.formats import attempt_object, attempt_prefixes
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.formats.parquet import data_key
from ditfleet.workers.output.formats.webdataset import webdataset_key
from ditfleet.workers.output.layout import (
    MAX_COMPONENT_BYTES,
    image_file_name,
    image_index_in_key,
    manifest_key,
    manifest_of_key,
    safe_key_component,
)
from ditfleet.workers.storage.base import check_key

T = "a0-0123456789abcdef"  # an attempt token (layout.new_attempt_token makes random ones)

LONG = "x" * 10_000
HOSTILE = [
    ("../x", "~2E.~2Fx"),
    ("..", "~2E."),
    (".", "~2E"),
    (".hidden", "~2Ehidden"),
    ("a/../../b", "a~2F..~2F..~2Fb"),
    ("/abs", "~2Fabs"),
    ("a\\b", "a~5Cb"),
    ("a\x00b", "a~00b"),
    ("a\nb\x7f", "a~0Ab~7F"),
    ("a b", "a~20b"),
    ("a_b", "a~5Fb"),
    ("a~b", "a~7Eb"),
    ("a%2Fb", "a~252Fb"),
    ("café", "caf~C3~A9"),
    ("日本", "~E6~97~A5~E6~9C~AC"),
    ("emoji🙂", "emoji~F0~9F~99~82"),
    ("", "~"),
    ("plain-id.v2", "plain-id.v2"),
    (12345, "12345"),
    (-7, "-7"),
]


@pytest.mark.parametrize(("raw", "expected"), HOSTILE)
def test_safe_key_component_table(raw: str | int, expected: str) -> None:
    got = safe_key_component(raw)
    assert got == expected
    # One component, no traversal, nothing a filesystem or S3 treats specially.
    assert "/" not in got and "\\" not in got and got not in (".", "..") and not got.startswith(".")
    assert all(0x21 <= ord(c) < 0x7F for c in got)
    check_key(f"images/00000/{got}.png")


def test_long_ids_are_bounded_and_stay_distinct() -> None:
    a, b = LONG, LONG[:-1] + "y"
    ka, kb = safe_key_component(a), safe_key_component(b)
    assert len(ka) <= MAX_COMPONENT_BYTES and len(kb) <= MAX_COMPONENT_BYTES
    assert ka != kb and "~~" in ka
    # A long id of escapes is cut at an escape boundary, never inside "~XX".
    escaped = safe_key_component("/" * 5_000)
    head = escaped.split("~~")[0]
    assert len(escaped) <= MAX_COMPONENT_BYTES and head.replace("~2F", "") == ""
    # The longest id that is not shortened, and the shortest that is.
    fits = "a" * MAX_COMPONENT_BYTES
    assert safe_key_component(fits) == fits
    assert "~~" in safe_key_component(fits + "a")


def test_distinct_ids_give_distinct_keys() -> None:
    alphabet = ["a", "_", "~", "%", "/", ".", "1", "é", "\x00", "~7E", "_1", "~~"]
    ids = {"".join(p) for n in range(1, 4) for p in itertools.product(alphabet, repeat=n)}
    ids |= {raw for raw, _ in HOSTILE if isinstance(raw, str)} | {LONG, LONG + "z"}
    assert len({safe_key_component(i) for i in ids}) == len(ids)
    # The "_k" suffix cannot make two images of different rows share a key.
    keys = [
        image_key(0, T, i, image_index_in_key(k, n), "png") for i in ids for n in (1, 2) for k in range(n)
    ]
    assert len(set(keys)) == len(keys)


def test_bad_ids_are_refused() -> None:
    for bad in (None, 1.5, True, b"bytes"):
        with pytest.raises(TypeError, match="id must be a str or int"):
            safe_key_component(bad)  # type: ignore[arg-type]


def test_layout_keys() -> None:
    assert image_key(3, T, "a/b", None, "png") == f"images/00003/{T}/a~2Fb.png"
    assert image_key(3, T, "x", 2, "jpg") == f"images/00003/{T}/x_2.jpg"
    assert image_key(123456, T, "x", 0, "webp") == f"images/123456/{T}/x_0.webp"
    assert image_file_name("x", 1, "png") == "x_1.png"
    assert manifest_key(7) == "manifests/shard-00007.parquet"
    assert data_key(7, T) == f"data/shard-00007-{T}.parquet"
    assert webdataset_key(7, T) == f"webdataset/shard-00007-{T}.tar"
    assert layout.job_key() == "_job.json" and layout.success_key() == "_SUCCESS"
    assert manifest_of_key(manifest_key(42)) == (42, 0)
    assert manifest_of_key(manifest_key(1_234_567)) == (1_234_567, 0)
    assert manifest_of_key("manifests/shard-00001.parquet.tmp") is None
    assert manifest_of_key("data/shard-00001.parquet") is None
    with pytest.raises(ValueError, match="extension"):
        image_key(0, T, "x", None, "gif")
    with pytest.raises(ValueError, match="shard index"):
        manifest_key(-1)
    with pytest.raises(ValueError, match="image index"):
        image_key(0, T, "x", -1, "png")
    with pytest.raises(ValueError, match="attempt token"):
        image_key(0, "../x", "x", None, "png")


@pytest.mark.parametrize(
    "key", ["", "/abs", "a/../b", "a//b", "./a", "a\\b", "a\x00b", "a/.ditfleet-tmp-x", "..", "a/"]
)
def test_stores_refuse_unsafe_keys(key: str) -> None:
    with pytest.raises(ValueError, match="object key"):
        check_key(key)


def test_attempt_tokens_and_attempt_objects() -> None:
    tokens = {layout.new_attempt_token(3) for _ in range(100)}
    assert len(tokens) == 100 and all(t.startswith("a3-") and len(t) == 19 for t in tokens)
    for key in (image_key(12, T, "x", None, "png"), data_key(12, T), webdataset_key(12, T)):
        assert attempt_object(key) == layout.AttemptObject(12, T)
        assert any(key.startswith(p) for p in attempt_prefixes(12))
        assert not any(key.startswith(p) for p in attempt_prefixes(1))
    for other in ("images/00012/x.png", "data/shard-00012.parquet", manifest_key(12), "_SUCCESS"):
        assert attempt_object(other) is None
    with pytest.raises(ValueError, match="attempt number"):
        layout.new_attempt_token(-1)
