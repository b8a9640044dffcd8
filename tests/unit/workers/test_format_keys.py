"""Every output format's object keys, pinned: the keys a format module declares (ShardObjects) are
the keys outputs written before the formats declared them hold, so verify, orphan cleaning and
supersession keep finding them; the registry reads shard, token and generation back from each."""

from __future__ import annotations

import re

import pytest

from ditfleet.workers.output.formats import FORMAT_NAMES, FORMATS, attempt_object, attempt_prefixes
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.formats.parquet import data_key
from ditfleet.workers.output.formats.webdataset import webdataset_key
from ditfleet.workers.output.layout import AttemptObject, ShardObjects, image_file_name
from ditfleet.workers.storage.base import write_check_key

RUNS = [(0, "a0-0123456789abcdef", 0), (7, "r2-a3-fedcba9876543210", 2), (123456, "a12-00000000000000ff", 0)]
IMAGES = [("p00001", None, "png"), ("a/b_c", 2, "webp"), ("../x", 0, "jpg"), ("café", None, "png")]

# The keys of the layout before each format declared its own (workers/output/layout.py's table).
PINNED: dict[str, dict[int, tuple[str, list[str]]]] = {
    "files": {
        s: (
            f"images/{s:05d}/",
            [
                f"images/{s:05d}/{t}/p00001.png",
                f"images/{s:05d}/{t}/a~2Fb~5Fc_2.webp",
                f"images/{s:05d}/{t}/~2E.~2Fx_0.jpg",
                f"images/{s:05d}/{t}/caf~C3~A9.png",
            ],
        )
        for s, t, _ in RUNS
    },
    "parquet": {s: (f"data/shard-{s:05d}-", [f"data/shard-{s:05d}-{t}.parquet"]) for s, t, _ in RUNS},
    "webdataset": {
        s: (f"webdataset/shard-{s:05d}-", [f"webdataset/shard-{s:05d}-{t}.tar"]) for s, t, _ in RUNS
    },
}


def _keys(name: str, shard: int, token: str) -> list[str]:
    if name == "files":
        return [image_key(shard, token, id_, k, ext) for id_, k, ext in IMAGES]
    return [{"parquet": data_key, "webdataset": webdataset_key}[name](shard, token)]


def test_every_registered_format_has_pinned_keys() -> None:
    assert set(FORMAT_NAMES) == set(PINNED), "a new format pins its keys here"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize(("shard", "token", "generation"), RUNS)
def test_format_keys_are_unchanged(fmt, shard: int, token: str, generation: int) -> None:
    prefix, keys = PINNED[fmt.name][shard]
    assert _keys(fmt.name, shard, token) == keys
    assert fmt.objects.prefix(shard) == prefix and prefix in attempt_prefixes(shard)
    names = [image_file_name(id_, k, ext) for id_, k, ext in IMAGES] if fmt.objects.suffix is None else [None]
    assert [fmt.objects.key(shard, token, n) for n in names] == keys
    for key in keys:
        assert attempt_object(key) == fmt.objects.match(key) == AttemptObject(shard, token, generation)
        assert key.startswith(fmt.objects.area)


def test_attempt_prefixes_follow_the_registered_order() -> None:
    assert attempt_prefixes(3) == ("images/00003/", "data/shard-00003-", "webdataset/shard-00003-")


def test_keys_of_no_format_or_of_no_run_are_not_attempt_objects() -> None:
    for key in (
        "images/00012/x.png",
        "data/shard-00012.parquet",
        "manifests/shard-00012.parquet",
        "_SUCCESS",
    ):
        assert attempt_object(key) is None
    # One format's shape under another's area is not an object of either.
    assert attempt_object("data/00001/a0-0123456789abcdef/x.png") is None
    assert attempt_object("images/shard-00001-a0-0123456789abcdef.parquet") is None


def test_a_format_declares_a_plain_area_and_suffix() -> None:
    for area in ("_tmp/", "manifests/", "Data/", "data", "a/b/"):
        with pytest.raises(ValueError, match="area"):
            ShardObjects(area)
    with pytest.raises(ValueError, match="suffix"):
        ShardObjects("lance/", "lance")
    lance = ShardObjects("lance/", ".lance")
    assert lance.key(4, "a1-0123456789abcdef") == "lance/shard-00004-a1-0123456789abcdef.lance"
    with pytest.raises(ValueError, match="object name"):
        lance.key(4, "a1-0123456789abcdef", "x.png")
    with pytest.raises(ValueError, match="object name"):
        ShardObjects("pngs/").key(4, "a1-0123456789abcdef", "a/b.png")


def test_write_check_key_is_unchanged_and_refuses_other_tokens() -> None:
    assert write_check_key("0123abcd" * 4) == "_tmp/write-check-0123abcd0123abcd0123abcd0123abcd"
    assert re.fullmatch(r"_tmp/write-check-[0-9a-f]{32}", write_check_key("f" * 32))
    with pytest.raises(ValueError, match="hex"):
        write_check_key("../x")
