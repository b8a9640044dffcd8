"""Provenance in every image: the row's prompt, seed, steps, CFG, the model and the job, in the file's
own metadata (PNG text chunks, EXIF and XMP for JPEG and WebP), read back with Pillow; the same
bytes every time; none of it with output.embed_metadata: false."""

from __future__ import annotations

import io
import json
import re
import tarfile
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PIL import Image

from ditfleet.workers.output.codec import encode_image, sha256_hex
from ditfleet.workers.output.formats import ImageTask, ShardWriterConfig, make_shard_writer
from ditfleet.workers.output.formats.base import encode_task_image
from ditfleet.workers.output.provenance import XMP_NAMESPACE, JobProvenance, Provenance
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet

T = "a0-0123456789abcdef"  # an attempt token
PROMPT = "un café à Paris, 東京"
NEGATIVE = "flou, « bruit »"
JOB = JobProvenance("tiny", "3f0c1a2b4d5e6f70", "démo-1")
TASK = ImageTask(
    id="p17",
    k=0,
    num_images=1,
    prompt=PROMPT,
    negative_prompt=NEGATIVE,
    seed=4242,
    steps=28,
    true_cfg_scale=4.0,
)
FORMATS = ["png", "jpeg", "webp"]
RDF = "{http://www.w3.org/1999/02/22-rdf-syntax-ns#}"
DC = "{http://purl.org/dc/elements/1.1/}"


def pixels(seed: int = 0, h: int = 24, w: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def provenance(prompt: str = PROMPT, job: JobProvenance = JOB) -> Provenance:
    return Provenance(prompt, NEGATIVE, 4242, 28, 4.0, 40, 24, "p17", 0, job)


def png_chunks(data: bytes) -> list[tuple[str, bytes]]:
    out, pos = [], 8
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        out.append((data[pos + 4 : pos + 8].decode(), data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return out


def a1111_pairs(last_line: str) -> dict[str, str]:
    """The key-value line as AUTOMATIC1111's own reader parses it (its re_param and unquote)."""
    pairs = {}
    for key, value in re.findall(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)', last_line):
        pairs[key] = json.loads(value) if value.startswith('"') else value
    return pairs


def exif_facts(image: Image.Image) -> tuple[str, str]:
    """(UserComment, ImageDescription) of an image's EXIF, decoded as their writers encode them."""
    exif = image.getexif()
    comment = exif.get_ifd(0x8769)[0x9286]
    assert comment[:8] == b"UNICODE\x00" and exif.endian == ">"  # UCS-2 in the block's byte order
    # Pillow decodes ASCII tags as Latin-1; the bytes are UTF-8 (as exiftool writes and reads them).
    description = exif[0x010E].encode("latin-1").decode("utf-8")
    return comment[8:].decode("utf-16-be"), description


def xmp_facts(image: Image.Image) -> tuple[dict[str, str], str | None]:
    """(ditfleet: elements, dc:description) of an image's XMP packet."""
    root = ET.fromstring(image.info["xmp"])
    desc = root.find(f"{RDF}RDF/{RDF}Description")
    assert desc is not None
    facts = {
        el.tag.removeprefix("{" + XMP_NAMESPACE + "}"): el.text or ""
        for el in desc
        if XMP_NAMESPACE in el.tag
    }
    li = desc.find(f"{DC}description/{RDF}Alt/{RDF}li")
    return facts, None if li is None else li.text


# -- the text forms -----------------------------------------------------------------------------


def test_parameters_text_is_the_a1111_form_its_reader_parses() -> None:
    text = provenance().parameters()
    prompt, negative, last = text.split("\n")
    assert prompt == PROMPT and negative == f"Negative prompt: {NEGATIVE}"
    assert a1111_pairs(last) == {
        "Steps": "28",
        "CFG scale": "4.0",
        "Seed": "4242",
        "Size": "40x24",
        "Model": "tiny",
        "Model hash": "3f0c1a2b4d5e6f70",
        "Job": "démo-1",
    }
    # A value with a comma or colon is quoted as JSON, as AUTOMATIC1111's quote() does.
    odd = Provenance("x", seed=1, job=JobProvenance("hf://org/name@main", "r", "a, b"))
    pairs = a1111_pairs(odd.parameters().split("\n")[-1])
    assert pairs["Model"] == "hf://org/name@main" and pairs["Job"] == "a, b"
    # No negative prompt (or a blank one, the default " "), nothing unknown: no line, no pair.
    assert Provenance("x", seed=1).parameters() == "x\nSeed: 1"
    assert Provenance("x", " ", seed=1).parameters() == "x\nSeed: 1"


def test_json_holds_every_fact() -> None:
    assert json.loads(provenance().to_json()) == {
        "prompt": PROMPT,
        "negative_prompt": NEGATIVE,
        "seed": 4242,
        "steps": 28,
        "true_cfg_scale": 4.0,
        "width": 40,
        "height": 24,
        "model_id": "tiny",
        "model_revision": "3f0c1a2b4d5e6f70",
        "job_name": "démo-1",
        "id": "p17",
        "k": 0,
    }


# -- per format, read back with Pillow ----------------------------------------------------------


def test_png_text_chunks_round_trip_utf8_as_itxt_and_latin1_as_text() -> None:
    p = provenance()
    data = encode_image(pixels(), "png", provenance=p)
    image = Image.open(io.BytesIO(data))
    assert image.text == {"parameters": p.parameters(), "ditfleet": p.to_json()}
    assert json.loads(image.text["ditfleet"])["prompt"] == PROMPT
    assert np.array_equal(np.asarray(image), pixels())  # the pixels are untouched
    kinds = [
        (kind, body.split(b"\x00", 1)[0])
        for kind, body in png_chunks(data)
        if kind in ("tEXt", "zTXt", "iTXt")
    ]
    assert kinds == [("iTXt", b"parameters"), ("iTXt", b"ditfleet")]  # 東京 is not Latin-1

    latin = Provenance("un café à Paris", "flou", 1, 2, 3.5, 40, 24, job=JobProvenance("tiny", "r", "j"))
    data = encode_image(pixels(), "png", provenance=latin)
    kinds = [
        (kind, body.split(b"\x00", 1)[0])
        for kind, body in png_chunks(data)
        if kind in ("tEXt", "zTXt", "iTXt")
    ]
    assert kinds == [("tEXt", b"parameters"), ("tEXt", b"ditfleet")]  # what A1111 writes
    assert Image.open(io.BytesIO(data)).text["parameters"] == latin.parameters()


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_jpeg_and_webp_carry_exif_and_xmp(fmt: str) -> None:
    p = provenance()
    image = Image.open(io.BytesIO(encode_image(pixels(), fmt, provenance=p)))
    assert image.format == fmt.upper() and image.size == (40, 24)
    assert exif_facts(image) == (p.parameters(), p.parameters())
    facts, description = xmp_facts(image)
    assert description == p.parameters()
    assert facts == {key: str(value) for key, value in p.facts().items()}
    assert facts["prompt"] == PROMPT and facts["seed"] == "4242" and facts["job_name"] == "démo-1"


def test_xmp_keeps_what_xml_cannot_hold_readable() -> None:
    p = Provenance("a <b> & c\r\nline\x07two", seed=1)
    image = Image.open(io.BytesIO(encode_image(pixels(), "webp", provenance=p)))
    facts, _ = xmp_facts(image)
    assert facts["prompt"] == "a <b> & c\r\nline\ufffdtwo"
    assert exif_facts(image)[0] == p.parameters()  # EXIF holds the text as it is


def test_a_long_prompt_never_fails_a_jpeg() -> None:
    """A JPEG segment holds 64 KiB: the blocks drop their duplicate text, then themselves."""
    medium = provenance("東京" * 9000)  # UTF-16 36 KB: EXIF fits once, not twice; XMP fits once
    image = Image.open(io.BytesIO(encode_image(pixels(), "jpeg", provenance=medium)))
    exif = image.getexif()
    assert 0x010E not in exif and exif.get_ifd(0x8769)[0x9286][8:].decode("utf-16-be") == medium.parameters()
    facts, description = xmp_facts(image)
    assert facts["prompt"] == medium.prompt and description is None
    huge = provenance("東京" * 40000)
    image = Image.open(io.BytesIO(encode_image(pixels(), "jpeg", provenance=huge)))
    assert "exif" not in image.info and "xmp" not in image.info
    # PNG and WebP have no such limit.
    assert (
        Image.open(io.BytesIO(encode_image(pixels(), "png", provenance=huge))).text["ditfleet"]
        == huge.to_json()
    )
    webp = Image.open(io.BytesIO(encode_image(pixels(), "webp", provenance=huge)))
    assert xmp_facts(webp)[0]["prompt"] == huge.prompt


# -- the shard writer's encode step: on by default, off on request, deterministic ---------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoding_with_metadata_is_deterministic(fmt: str) -> None:
    cfg = ShardWriterConfig(image_format=fmt, job=JOB)  # type: ignore[arg-type]
    first = encode_task_image(cfg, TASK, pixels())
    again = encode_task_image(cfg, TASK, pixels().copy())
    assert first[0] is not None and first[0] == again[0]
    assert first[2:] == (None, 40, 24)
    # The metadata is a function of the row and the job: another job name, other bytes.
    other = encode_task_image(
        ShardWriterConfig(image_format=fmt, job=JobProvenance("tiny", "3f0c1a2b4d5e6f70", "b")),
        TASK,
        pixels(),
    )  # type: ignore[arg-type]
    assert other[0] != first[0]


def _as_before(image: np.ndarray, fmt: str) -> bytes:
    """What the encoder wrote before images carried metadata (Pillow with the same settings)."""
    buf = io.BytesIO()
    picture = Image.fromarray(image)
    if fmt == "png":
        picture.save(buf, format="PNG", compress_level=6, optimize=False)
    elif fmt == "webp":
        picture.save(buf, format="WEBP", quality=90, method=4, exact=False)
    else:
        picture.save(buf, format="JPEG", quality=95, optimize=False, progressive=False)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", FORMATS)
def test_embed_metadata_false_writes_the_bytes_of_before(fmt: str) -> None:
    cfg = ShardWriterConfig(image_format=fmt, embed_metadata=False, job=JOB)  # type: ignore[arg-type]
    data, _, error, _, _ = encode_task_image(cfg, TASK, pixels())
    assert error is None and data == _as_before(pixels(), fmt)
    image = Image.open(io.BytesIO(data))
    assert not {"exif", "xmp", "parameters", "ditfleet"} & set(image.info)
    on, _, _, _, _ = encode_task_image(ShardWriterConfig(image_format=fmt, job=JOB), TASK, pixels())  # type: ignore[arg-type]
    assert on is not None and on != data
    # Same pixels either way.
    decoded_on = np.asarray(Image.open(io.BytesIO(on)).convert("RGB"))
    assert np.array_equal(decoded_on, np.asarray(image.convert("RGB")))


# -- end to end through the real shard writers --------------------------------------------------


def _stored_images(store, fmt: str, stored) -> dict[str, bytes]:
    """id -> the stored image bytes, read from the objects the writer stored."""
    if fmt == "files":
        return {r.id: store.get(r.uri.removeprefix(store.uri("")).lstrip("/")) for r in stored.results}
    key = stored.data_uri.removeprefix(store.uri("")).lstrip("/")
    blob = store.get(key)
    if fmt == "parquet":
        table = read_parquet(blob).to_pylist()
        return {row["id"]: row["image"]["bytes"] for row in table}
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {
            m.name.rsplit(".", 1)[0]: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if not m.name.endswith(".json")
        }


@pytest.mark.parametrize(
    ("output_format", "image_format"), [("files", "png"), ("parquet", "jpeg"), ("webdataset", "webp")]
)
def test_every_output_format_stores_images_that_carry_their_row(
    tmp_path, output_format, image_format
) -> None:
    store = open_store(str(tmp_path / "out"))
    cfg = ShardWriterConfig(output_format=output_format, image_format=image_format, threads=2, job=JOB)  # type: ignore[arg-type]
    tasks = [
        ImageTask(
            id=f"r{i}",
            prompt=f"{PROMPT} n°{i}",
            negative_prompt=None if i else NEGATIVE,
            seed=100 + i,
            steps=20 + i,
            true_cfg_scale=3.5,
        )
        for i in range(3)
    ]
    writer = make_shard_writer(store, 0, cfg, T)
    for i, task in enumerate(tasks):
        writer.add(task, pixels(i))
    stored = writer.finish()
    images = _stored_images(store, output_format, stored)
    for task, result in zip(tasks, stored.results):
        data = images[task.id]
        assert sha256_hex(data) == result.sha256 and len(data) == result.bytes  # the manifest's facts
        image = Image.open(io.BytesIO(data))
        if image_format == "png":
            facts = json.loads(image.text["ditfleet"])
            text = image.text["parameters"]
        else:
            text, _ = exif_facts(image)
            facts = xmp_facts(image)[0]
        assert facts["prompt"] == task.prompt and str(facts["seed"]) == str(task.seed)
        assert str(facts["steps"]) == str(task.steps) and facts["job_name"] == "démo-1"
        assert text.startswith(task.prompt + "\n") and f"Seed: {task.seed}," in text
        assert ("Negative prompt: " in text) == (task.negative_prompt is not None)


@pytest.mark.slow
def test_the_worker_stores_images_that_carry_their_row_model_and_job(random_model_dir, tmp_path) -> None:
    """The real actor on a small shard: each stored PNG names its row's prompt, seed, steps and
    CFG, the model the actor loaded and the job, and the manifest's sha256 is of those bytes."""
    import dataclasses

    from ditfleet.workers.actor import GenerationWorker
    from ditfleet.workers.output.manifest import read_manifests
    from tests.support.worker_fixtures import row_config, shard_of, worker_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 3)
    rows = row_config(steps=1, cfg=2.5, buckets=("16x16",))
    config = dataclasses.replace(
        worker_config(random_model_dir, str(tmp_path / "out"), rows=rows), job_name="provenance-test"
    )
    worker = GenerationWorker(config)
    result = worker.run_shard(shard_of(prompts, 0, 0, 3, buckets=("16x16",)))
    assert result.images_ok == 3
    store = open_store(str(tmp_path / "out"))
    manifest = read_manifests(store).to_pylist()
    revision = worker.startup_report()["model_revision"]
    assert revision
    for row in manifest:
        data = store.get(row["uri"].removeprefix(store.uri("")).lstrip("/"))
        assert sha256_hex(data) == row["sha256"] and len(data) == row["bytes"]
        image = Image.open(io.BytesIO(data))
        facts = json.loads(image.text["ditfleet"])
        assert image.text["parameters"].startswith(
            f"{row['prompt']}\nSteps: 1, CFG scale: 2.5, Seed: {row['seed']},"
        )
        assert facts == {
            "prompt": row["prompt"],
            "negative_prompt": row["negative_prompt"],  # the job's default, " "
            "seed": row["seed"],
            "steps": 1,
            "true_cfg_scale": 2.5,
            "width": 16,
            "height": 16,
            "model_id": str(random_model_dir),
            "model_revision": revision,
            "job_name": "provenance-test",
            "id": row["id"],
            "k": 0,
        }


# -- hostile prompts: what AUTOMATIC1111-style readers take from the infotext ---------------------

_RE_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def a1111_read(text: str) -> tuple[str, str, dict[str, str]]:
    """(prompt, negative prompt, settings) as AUTOMATIC1111's own reader takes them from an
    infotext (`parse_generation_parameters`, modules/infotext_utils.py), line for line."""
    prompt, negative, done_with_prompt = "", "", False
    *lines, lastline = text.strip().split("\n")
    if len(_RE_PARAM.findall(lastline)) < 3:
        lines.append(lastline)
        lastline = ""
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            done_with_prompt = True
            line = line[16:].strip()
        if done_with_prompt:
            negative += ("" if negative == "" else "\n") + line
        else:
            prompt += ("" if prompt == "" else "\n") + line
    settings = {}
    for key, value in _RE_PARAM.findall(lastline):
        if value[:1] == '"' and value[-1:] == '"':
            try:
                value = json.loads(value)  # its unquote()
            except ValueError:
                pass
        settings[key] = value
    return prompt, negative, settings


def unescaped(block: str) -> str:
    """A prompt block of the infotext as docs/quality.md says to read it: a JSON string where it
    starts with a quote, else the text itself."""
    return json.loads(block) if block.startswith('"') else block


HOSTILE = [
    "a cat\nNegative prompt: a dog",
    "Negative prompt: the prompt starts with the label",
    "a cat\nSteps: 1, CFG scale: 9.0, Seed: 7, Size: 8x8",
    'say "hi", then: leave',
    '"all quoted"',
    "  spaces at both ends  ",
    "windows\r\nlines\r",
    "\nstarts with a newline",
    "ends with a newline\n",
    "two\n\nparagraphs",
    "un café à 東京 🙂\u2028line separator",
    "nul\x00inside",
    "a backslash \\n and a tab\tinside",
    "",
]


@pytest.mark.parametrize("prompt", HOSTILE)
@pytest.mark.parametrize(
    "negative", [None, "blurry\nNegative prompt: sharp", "x\nSteps: 99, Seed: 1, Size: 1x1", "ok"]
)
def test_hostile_prompts_round_trip_through_an_a1111_reader(prompt, negative) -> None:
    p = Provenance(prompt, negative, 4242, 28, 4.0, 40, 24, "p17", 0, JOB)
    texts = {"str": p.parameters()}
    png = Image.open(io.BytesIO(encode_image(pixels(), "png", provenance=p)))
    texts["png"] = png.text["parameters"]
    assert json.loads(png.text["ditfleet"])["prompt"] == prompt  # the JSON chunk holds it exactly
    for fmt in ("jpeg", "webp"):
        texts[fmt] = exif_facts(Image.open(io.BytesIO(encode_image(pixels(), fmt, provenance=p))))[0]
    for where, text in texts.items():
        read_prompt, read_negative, settings = a1111_read(text)
        assert unescaped(read_prompt) == prompt, (where, text)
        assert unescaped(read_negative) == (negative or ""), (where, text)
        assert (settings["Steps"], settings["Seed"], settings["Size"], settings["Job"]) == (
            "28",
            "4242",
            "40x24",
            "démo-1",
        )
        if (
            prompt == prompt.strip()
            and "\r" not in prompt
            and "\x00" not in prompt
            and not prompt.startswith('"')
        ):
            if not any(line.startswith("Negative prompt:") for line in prompt.split("\n")):
                assert read_prompt == prompt  # what the form holds stays as it is, not escaped


def test_setting_values_a_reader_would_change_are_quoted() -> None:
    job = JobProvenance('"quoted" model', " padded ", "a, b: c")
    _, _, settings = a1111_read(Provenance("x", seed=1, steps=2, job=job).parameters())
    assert (settings["Model"], settings["Model hash"], settings["Job"]) == (
        '"quoted" model',
        " padded ",
        "a, b: c",
    )


# -- edit jobs: the image says it is an edit, and of which sources ------------------------------

SOURCES = (("s3://in/cat.png", "a" * 64), ("in.parquet#row=3&image=1", "b" * 64))


def _edit(sources=SOURCES, prompt: str = "make the cat blue") -> Provenance:
    return Provenance(prompt, None, 4242, 28, 4.0, 40, 24, "p17", 0, JOB, sources=sources)


def test_an_edit_names_its_sources_in_every_form() -> None:
    p = _edit()
    assert json.loads(p.to_json())["task"] == "edit"
    assert json.loads(p.to_json())["sources"] == [
        {"uri": "s3://in/cat.png", "sha256": "a" * 64},
        {"uri": "in.parquet#row=3&image=1", "sha256": "b" * 64},
    ]
    _, _, settings = a1111_read(p.parameters())
    assert {k: v for k, v in settings.items() if k.startswith(("Task", "Source"))} == {
        "Task": "edit",
        "Source 1": "s3://in/cat.png",
        "Source 1 sha256": "a" * 64,
        "Source 2": "in.parquet#row=3&image=1",
        "Source 2 sha256": "b" * 64,
    }
    assert settings["Seed"] == "4242"  # the settings around them read as before
    png = Image.open(io.BytesIO(encode_image(pixels(), "png", provenance=p)))
    assert png.text == {"parameters": p.parameters(), "ditfleet": p.to_json()}
    for fmt in ("jpeg", "webp"):
        image = Image.open(io.BytesIO(encode_image(pixels(), fmt, provenance=p)))
        assert exif_facts(image) == (p.parameters(), p.parameters())
        assert xmp_sources(image) == [{"uri": u, "sha256": h} for u, h in SOURCES]
        assert xmp_facts(image)[0]["task"] == "edit"
    # A text job's image carries none of it: its metadata is what it was.
    text = provenance()
    assert "task" not in text.facts() and "Task" not in a1111_read(text.parameters())[2]
    assert Provenance(PROMPT, NEGATIVE, 4242, 28, 4.0, 40, 24, "p17", 0, JOB, sources=None) == text


def xmp_sources(image: Image.Image) -> list[dict[str, str]]:
    """The ditfleet:sources rdf:Seq of an image's XMP, as a list of {uri, sha256}."""
    root = ET.fromstring(image.info["xmp"])
    seq = root.find(f"{RDF}RDF/{RDF}Description/{{{XMP_NAMESPACE}}}sources/{RDF}Seq")
    assert seq is not None
    return [
        {el.tag.removeprefix("{" + XMP_NAMESPACE + "}"): el.text or "" for el in li}
        for li in seq.findall(f"{RDF}li")
    ]


@pytest.mark.parametrize(
    "uri", [*HOSTILE, 'x", Seed: 1, Size: 1x1', "s3://b/a, b: c.png", "café/東京 🙂.png"]
)
def test_hostile_source_uris_round_trip_as_prompts_do(uri) -> None:
    """A URI is quoted where the infotext would change it (as setting values are), so a reader
    gets it back exactly and no setting is forged; the JSON chunk and XMP hold it as given (XMP:
    characters XML cannot hold as U+FFFD, as for prompts)."""
    p = _edit(((uri, "c" * 64), ("s3://in/b.png", "d" * 64)))
    png = Image.open(io.BytesIO(encode_image(pixels(), "png", provenance=p)))
    assert json.loads(png.text["ditfleet"])["sources"][0]["uri"] == uri
    texts = [png.text["parameters"]]
    webp = Image.open(io.BytesIO(encode_image(pixels(), "webp", provenance=p)))
    texts.append(exif_facts(webp)[0])
    for text in texts:
        prompt, negative, settings = a1111_read(text)
        assert (prompt, negative) == ("make the cat blue", "")
        assert settings["Source 1"] == uri and settings["Source 1 sha256"] == "c" * 64
        assert settings["Source 2"] == "s3://in/b.png" and settings["Seed"] == "4242"
        assert settings["Size"] == "40x24" and settings["Task"] == "edit"
    expected = re.sub("[\x00-\x08\x0b\x0c\x0e-\x1f]", "\ufffd", uri)
    assert xmp_sources(webp)[0]["uri"] == expected


def test_a_source_is_a_pair_of_strings() -> None:
    with pytest.raises(ValueError, match="id='p17': a source is a \\(uri, sha256\\) pair of str"):
        _edit((("s3://in/a.png",),))
    with pytest.raises(ValueError, match="pair of str"):
        _edit((("s3://in/a.png", None),))


@pytest.mark.parametrize(
    ("output_format", "image_format"), [("files", "png"), ("parquet", "jpeg"), ("webdataset", "webp")]
)
def test_every_output_format_stores_edits_that_name_their_sources(
    tmp_path, output_format, image_format
) -> None:
    store = open_store(str(tmp_path / "out"))
    cfg = ShardWriterConfig(output_format=output_format, image_format=image_format, threads=2, job=JOB)  # type: ignore[arg-type]
    tasks = [ImageTask(id=f"r{i}", prompt="make it blue", seed=i, sources=SOURCES[: i + 1]) for i in range(2)]
    writer = make_shard_writer(store, 0, cfg, T)
    for i, task in enumerate(tasks):
        writer.add(task, pixels(i))
    images = _stored_images(store, output_format, writer.finish())
    for task in tasks:
        image = Image.open(io.BytesIO(images[task.id]))
        if image_format == "png":
            sources = [(s["uri"], s["sha256"]) for s in json.loads(image.text["ditfleet"])["sources"]]
        else:
            sources = [(s["uri"], s["sha256"]) for s in xmp_sources(image)]
        assert tuple(sources) == task.sources
