"""The output layout, defined once: every object key a job writes is built here.

```
{out}/_job.json                                     job_key()
{out}/_SUCCESS                                      success_key()
{out}/{area}shard-{shard:05d}-{attempt}{suffix}    ShardObjects(area, suffix).key(shard, attempt)
{out}/{area}{shard:05d}/{attempt}/{name}           ShardObjects(area).key(shard, attempt, name)
{out}/manifests/shard-{shard:05d}.parquet           manifest_key(shard)
{out}/manifests/shard-{shard:05d}.redo-{g}.parquet  manifest_key(shard, g)  (a redo: supersedes the lower generations)
{out}/_runs/{run:05d}.json                          run_key(run)  (incremental jobs: one per run)
{out}/_runs/{run:05d}-{token}.ids.parquet           run_ids_key(run, token)
{out}/_lease/{generation:08d}.json                  lease_key(generation)  (the driver that owns the output)
{out}/_superseded/{key}                             superseded_key(key)  (a superseded generation's manifest and objects)
```

The two ShardObjects lines are the shapes an output format's objects take: each format module
(workers/output/formats/) declares its area and suffix (e.g. "files": images/{shard}/{attempt}/
{id}[_{k}].{ext}, one object per image named by `image_file_name`; "parquet": data/shard-...
.parquet), and the registry there finds any format's objects by them.

Keys are relative to the output root and always use "/" as separator; stores join them to
their root. Ids from the input go through `safe_key_component`, so no input can address an
object outside the output root.

Attempt-scoped objects. `{attempt}` is an attempt token, "a{n}-{16 hex}" for a shard's first
generation and "r{g}-a{n}-{16 hex}" for a redo's generation g (`new_attempt_token`): the
generation the run commits, the attempt number and 64 random bits drawn by the worker each time
it starts a shard. So every object's key says which manifest key decides its fate
(`ShardObjects.match(key).generation`, `manifest_key(shard, generation)`). Every
object a run of a shard writes (images, data file, tar) has its run's token in its key, so two
runs of a shard never write the same key, whatever they generate: a speculative twin, a
straggler after a kill, or a retry after an OOM split (whose pixels differ at rounding level)
writes next to the others, never over them. Only the manifest key is shared, and it is written
create-only: the first run to commit names its own objects, and no later write can change them.
The objects of every other run of a committed shard are orphans no manifest names
(workers.output.formats `attempt_object`, `attempt_prefixes` find them; driver.output.orphans holds the one rule that
deletes them).

A superseded generation (a redo committed a higher one) is moved, manifest and objects, under
`_superseded/` with the same relative keys (`superseded_key`), and its manifest key is
overwritten by a zero-row tombstone (workers.output.manifest): the reader-visible folders hold
the current generation only; pyarrow, `datasets` and the documented globs skip `_`-prefixed
paths.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import typing
from dataclasses import dataclass, field
from typing import Literal

MANIFESTS_PREFIX = "manifests/"
RUNS_PREFIX = "_runs/"
LEASE_PREFIX = "_lease/"
SUPERSEDED_PREFIX = "_superseded/"
SCORES_PREFIX = "scores/"

# The encodings a job may name, and each one's file extension (the codec's format names).
ImageFormat = Literal["png", "webp", "jpeg"]
IMAGE_FORMATS: tuple[ImageFormat, ...] = typing.get_args(ImageFormat)
IMAGE_EXTENSIONS = {"png": "png", "webp": "webp", "jpeg": "jpg"}

# A component plus "_{k}.{ext}" must fit a file name (255 bytes on common filesystems) and
# leave room in S3's 1024-byte key for the output prefix.
MAX_COMPONENT_BYTES = 200
_HASH_HEX = 32  # 128 bits of sha256: collisions among shortened ids are not a practical concern

# A redo of a committed shard commits generation g >= 1 next to the first one (never over it).
_SHARD_FILE = re.compile(r"^shard-(\d{5,})(?:\.redo-([1-9]\d*))?\.parquet$")
_RUN_FILE = re.compile(r"^(\d{5,})\.json$")
_LEASE_FILE = re.compile(r"^(\d{8,})\.json$")
_TOKEN = re.compile(r"^[0-9a-f]{1,64}$")
# "r{g}-" is present for a redo's generation g >= 1 only: a plain token is generation 0.
_ATTEMPT = r"(?:r[1-9]\d{0,8}-)?a\d{1,6}-[0-9a-f]{16}"
_ATTEMPT_TOKEN = re.compile(f"^{_ATTEMPT}$")
_TOKEN_GENERATION = re.compile(r"^r([1-9]\d{0,8})-")
# An output format's area ("images/") and its one object's suffix (".parquet"): ShardObjects.
_AREA = re.compile(r"^[a-z][a-z0-9_-]*/$")
_SUFFIX = re.compile(r"^\.[a-z0-9]+(?:\.[a-z0-9]+)*$")
# Kept as is: ASCII letters, digits, "-" and "." (a leading "." is escaped so that no component
# is "." or "..", or a hidden file). Everything else, "_" (the k separator) and "~" (the escape
# character) included, becomes "~XX" per UTF-8 byte.
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-.")


def safe_key_component(id_: str | int) -> str:
    """Turn an input id into one safe object-key component (deterministic, injective).

    Escaping, not dropping, keeps distinct ids distinct: "a/b" -> "a~2Fb", "a_b" -> "a~5Fb",
    "../x" -> "~2E.~2Fx", "café" -> "caf~C3~A9". The escape character is "~" rather than "%"
    because "%XX" in a key is decoded by any tool that pastes the key into a URL. An id whose
    escaped form exceeds MAX_COMPONENT_BYTES is cut at an escape boundary and suffixed with
    "~~" + 32 hex digits of sha256(id); "~~" never occurs in an unshortened form, so a shortened
    key cannot equal an unshortened one. The empty id maps to "~" (no other id does).

    Integer ids are formatted in decimal, so the ids 7 and "7" share a key: a job's id column
    has one type, so this cannot happen within a job.
    """
    if isinstance(id_, bool) or not isinstance(id_, (str, int)):
        raise TypeError(f"an id must be a str or int, got {type(id_).__name__}: {id_!r}")
    text = str(id_)
    if text == "":
        return "~"
    parts: list[str] = []
    for i, ch in enumerate(text):
        if ch in _SAFE and not (i == 0 and ch == "."):
            parts.append(ch)
        else:
            parts.extend(f"~{b:02X}" for b in ch.encode("utf-8", errors="surrogatepass"))
    escaped = "".join(parts)
    if len(escaped) <= MAX_COMPONENT_BYTES:
        return escaped
    digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:_HASH_HEX]
    budget = MAX_COMPONENT_BYTES - 2 - _HASH_HEX
    head = escaped[:budget]
    # Do not cut a "~XX" escape in two: drop a trailing partial escape.
    tilde = head.rfind("~", max(0, budget - 2))
    if tilde != -1:
        head = head[:tilde]
    return f"{head}~~{digest}"


def _whole(value: object, what: str, lo: int = 0, hi: float = math.inf) -> int:
    """`value` when it is an int (not a bool) in [lo, hi]; else ValueError "{what}, got {value!r}"."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{what}, got {value!r}")
    return value


def _shard(shard: int) -> str:
    return f"{_whole(shard, 'a shard index must be an int >= 0'):05d}"


def k_suffix(k: int | None) -> str:
    """ "_{k}" for an image index k, "" for None (a row's only image): the tail of its names."""
    return "" if k is None else f"_{_whole(k, 'image index k must be an int >= 0 or None')}"


def new_attempt_token(attempt: int, generation: int = 0) -> str:
    """A fresh token for one run of a shard that commits manifest generation `generation`:
    "a{attempt}-{16 hex}" for generation 0 (the form outputs of earlier versions hold too),
    "r{generation}-a{attempt}-{16 hex}" for a redo's generation >= 1; 64 random bits.

    Drawn anew for every run, also for two runs with the same attempt number (a queued run moved
    to an idle actor keeps its number, and the original may start anyway)."""
    _whole(attempt, "an attempt number must be an int in 0..999999", hi=10**6 - 1)
    _whole(generation, "a manifest generation must be an int in 0..999999999", hi=10**9 - 1)
    redo = f"r{generation}-" if generation else ""
    return f"{redo}a{attempt}-{secrets.token_hex(8)}"


def token_generation(token: str) -> int:
    """The manifest generation a run with this attempt token commits (0 for a plain token)."""
    match = _TOKEN_GENERATION.match(_attempt(token))
    return int(match.group(1)) if match else 0


def _attempt(token: str) -> str:
    if not isinstance(token, str) or not _ATTEMPT_TOKEN.match(token):
        raise ValueError(
            "an attempt token looks like 'a0-0123456789abcdef' or 'r1-a0-0123456789abcdef' "
            f"(new_attempt_token), got {token!r}"
        )
    return token


def image_index_in_key(k: int, num_images: int) -> int | None:
    """The k that goes into an image's file name (`image_file_name`): None for a row's only
    image, else k itself.

    Collision-free because `safe_key_component` escapes "_": "{id}_{k}" of one row can never
    equal the escaped id of another.
    """
    return None if num_images == 1 else k


def image_file_name(id_: str | int, k: int | None, ext: str) -> str:
    """An image's file name, {id}[_{k}].{ext}: its object's last key component in the "files"
    format, the `path` of an embedded image in the "parquet" format. k as `image_index_in_key`
    gives it (None for a row's only image)."""
    if ext not in IMAGE_EXTENSIONS.values():
        raise ValueError(f"image extension {ext!r} is not one of {sorted(IMAGE_EXTENSIONS.values())}")
    return f"{safe_key_component(id_)}{k_suffix(k)}.{ext}"


@dataclass(frozen=True)
class AttemptObject:
    """What a key of the shard data areas says: which shard, which run (token), and which
    manifest generation that run commits (so `manifest_key(shard, generation)` decides its fate)."""

    shard: int
    attempt: str
    generation: int = 0


@dataclass(frozen=True)
class ShardObjects:
    """Where an output format keeps the objects one run of a shard writes, as its module declares
    it: under `area` (a folder of its own, e.g. "data/"), either one object per run,
    {area}shard-{shard:05d}-{attempt}{suffix}, or with no suffix a folder per run holding one
    object per image, {area}{shard:05d}/{attempt}/{name}. Either way every key carries the run's
    attempt token, and `match` reads shard, token and generation back from it."""

    area: str
    suffix: str | None = None
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _AREA.match(self.area) or self.area.startswith("_") or self.area == MANIFESTS_PREFIX:
            raise ValueError(
                f"an output format's area is a lower-case folder such as 'data/', got {self.area!r}"
            )
        if self.suffix is not None and not _SUFFIX.match(self.suffix):
            raise ValueError(f"an output format's object suffix looks like '.parquet', got {self.suffix!r}")
        rest = "/[^/]+" if self.suffix is None else re.escape(self.suffix)
        sep = "/" if self.suffix is None else "-"
        start = "" if self.suffix is None else "shard-"
        pattern = re.compile(rf"^{re.escape(self.area)}{start}(\d{{5,}}){sep}({_ATTEMPT}){rest}$")
        object.__setattr__(self, "_pattern", pattern)

    @property
    def per_image(self) -> bool:
        """Whether each image is an object of its own, named after its row's id (a folder per run):
        ids that a store folds to one name would then name one object (driver.output.case_fold)."""
        return self.suffix is None

    def key(self, shard: int, attempt: str, name: str | None = None) -> str:
        """Key of the object run `attempt` of `shard` writes; `name`: the object's file name in a
        folder per run (image_file_name), None for the one object per run."""
        if (name is None) != (self.suffix is not None) or (name is not None and "/" in name):
            raise ValueError(
                f"{self.area}: a folder per run takes an object name without '/', one object per run none"
            )
        if self.suffix is not None:
            return f"{self.prefix(shard)}{_attempt(attempt)}{self.suffix}"
        return f"{self.prefix(shard)}{_attempt(attempt)}/{name}"

    def prefix(self, shard: int) -> str:
        """The prefix every run of `shard` writes its objects under (no other shard's objects)."""
        return f"{self.area}{_shard(shard)}/" if self.suffix is None else f"{self.area}shard-{_shard(shard)}-"

    def match(self, key: str) -> AttemptObject | None:
        """Shard, attempt token and generation of an object key of this format; None for any
        other key (outputs of earlier versions had keys without a token)."""
        found = self._pattern.match(key)
        if found is None:
            return None
        token = found.group(2)
        return AttemptObject(int(found.group(1)), token, token_generation(token))


def manifest_key(shard: int, generation: int = 0) -> str:
    """Key of a shard's manifest of `generation`; its existence is that generation's commit.

    Generation 0 is the shard's first commit; a redo (`ditfleet run --redo-shards`) commits
    generation g >= 1 as shard-{shard}.redo-{g}.parquet, create-only like the first, so no
    committed manifest is ever changed. The highest generation present is the shard's current
    manifest (manifest.current_manifest_keys): readers read it alone.
    """
    if generation < 0:
        raise ValueError(f"manifest generation must be >= 0, got {generation}")
    suffix = f".redo-{generation}" if generation else ""
    return f"{MANIFESTS_PREFIX}shard-{_shard(shard)}{suffix}.parquet"


def manifest_prefix(shard: int) -> str:
    """The prefix every generation's manifest of `shard` starts with (no other shard's does)."""
    return f"{MANIFESTS_PREFIX}shard-{_shard(shard)}."


def manifest_of_key(key: str) -> tuple[int, int] | None:
    """(shard, generation) of a manifest key, or None for any other key."""
    if not key.startswith(MANIFESTS_PREFIX):
        return None
    match = _SHARD_FILE.match(key[len(MANIFESTS_PREFIX) :])
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


_SCORER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def score_table_key(scorer: str, manifest: str) -> str:
    """Key of the scores `ditfleet score` made with `scorer` from the manifest at key `manifest`:
    scores/{scorer}/ and the manifest's own file name, so a table names the generation it was made
    from, and a redo's scores can never be taken for the superseded generation's."""
    if not _SCORER_NAME.match(scorer):
        raise ValueError(f"scorer name {scorer!r}: use lower-case letters, digits and _ (at most 32)")
    if manifest_of_key(manifest) is None:
        raise ValueError(f"{manifest!r} is not a shard manifest key")
    return f"{SCORES_PREFIX}{scorer}/{manifest[len(MANIFESTS_PREFIX) :]}"


def manifest_of_score_table(scorer: str, key: str) -> str | None:
    """The manifest key a score table of `scorer` was made from, or None for any other key."""
    prefix = f"{SCORES_PREFIX}{scorer}/"
    if not key.startswith(prefix):
        return None
    manifest = MANIFESTS_PREFIX + key[len(prefix) :]
    return manifest if manifest_of_key(manifest) is not None else None


def superseded_key(key: str) -> str:
    """Where a superseded generation's manifest or object `key` is kept: the same relative key
    under `_superseded/`, which the readers the docs show skip."""
    if key.startswith(SUPERSEDED_PREFIX):
        raise ValueError(f"{key!r} is under {SUPERSEDED_PREFIX} already")
    return f"{SUPERSEDED_PREFIX}{key}"


def run_key(run: int) -> str:
    """Key of an incremental job's run record: which shards run `run` planned, over which rows."""
    return f"{RUNS_PREFIX}{_run(run)}.json"


def run_ids_key(run: int, token: str) -> str:
    """Key of the ids a run planned (one row per input row: shard, id). The token (hex) makes
    the key unique to one planning attempt, so two drivers planning the same run number never
    write the same object; the run record names the one that belongs to it."""
    if not _TOKEN.match(token):
        raise ValueError(f"a run token must be 1..64 lowercase hex digits, got {token!r}")
    return f"{RUNS_PREFIX}{_run(run)}-{token}.ids.parquet"


def _number_of(key: str, prefix: str, pattern: re.Pattern[str]) -> int | None:
    match = pattern.match(key[len(prefix) :]) if key.startswith(prefix) else None
    return int(match.group(1)) if match else None


def run_of_key(key: str) -> int | None:
    """The run number of a key made by run_key, or None for any other key."""
    return _number_of(key, RUNS_PREFIX, _RUN_FILE)


def _run(run: int) -> str:
    return f"{_whole(run, 'a run number must be an int >= 1', lo=1):05d}"


def lease_key(generation: int) -> str:
    """Key of generation `generation` of the output's driver lease (driver.output.lease); each
    generation is written create-only, so of two drivers taking the next one, one wins."""
    return f"{LEASE_PREFIX}{_whole(generation, 'a lease generation must be an int >= 0'):08d}.json"


def lease_of_key(key: str) -> int | None:
    """The generation of a key made by lease_key, or None for any other key."""
    return _number_of(key, LEASE_PREFIX, _LEASE_FILE)


def job_key() -> str:
    return "_job.json"


def success_key() -> str:
    return "_SUCCESS"
