"""An edit shard's batches: rows share their sources' number and encoded sizes (the edit
pipeline stacks their latents), and rows whose sources cannot be used leave their batch as
failed images with the reason, without the pipeline being called for them."""

from __future__ import annotations

from ditfleet.model import load_pipeline
from ditfleet.model.family import source_size
from ditfleet.workers.generate import BatchGenerator, image_requests, iter_generated, plan_batches
from ditfleet.workers.source_prefetch import SourcePrefetch
from ditfleet.workers.sources import SourceReader
from tests.unit.workers.test_sources import EDIT, planned_rows, write_image, write_input


def test_batches_share_the_number_and_encoded_sizes_of_their_sources(tmp_path):
    write_image(tmp_path / "wide.png", 80, 48)
    write_image(tmp_path / "wider.png", 160, 96)  # another size, encoded as wide.png is
    write_image(tmp_path / "tall.png", 48, 80)
    uri = write_input(
        tmp_path / "p.parquet",
        [["wide.png"], ["tall.png"], ["wider.png"], ["wide.png", "tall.png"], ["wide.png"]],
        width=[32] * 5,
        height=[32] * 5,  # one bucket for all: only the sources tell them apart
    )
    _, rows = planned_rows(uri)
    assert source_size(80, 48) == source_size(160, 96) != source_size(48, 80)
    batches = plan_batches(image_requests(rows), batch_size=8)
    assert [[r.row.id for r in b] for b in batches] == [["0", "2", "4"], ["1"], ["3"]]


def test_rows_with_unusable_sources_fail_with_their_reason_and_never_reach_the_pipeline(tmp_path):
    (tmp_path / "text.png").write_bytes(b"no image")
    uri = write_input(tmp_path / "p.parquet", [["gone.png"], ["text.png"]])
    _, rows = planned_rows(uri)

    assert [(g.request.row.id, g.pixels, g.error) for g in _generate_on_a_text_model(rows)] == [
        ("0", None, f"source 0 ({tmp_path}/gone.png) is missing"),
        ("1", None, f"source 0 ({tmp_path}/text.png) is not an image Pillow reads"),
    ]


def test_a_row_with_more_sources_than_the_model_takes_fails_alone_on_the_actor(tmp_path):
    """Where validation could not read the model (an s3:// one), the actor knows its limit
    (model.family.model_max_sources of the fetched folder): such a row fails with the reason,
    never reaching the pipeline (which would refuse the whole batch, so the shard, every attempt)."""
    write_image(tmp_path / "a.png", 48, 32)
    write_image(tmp_path / "b.png", 48, 32)
    uri = write_input(tmp_path / "p.parquet", [["a.png", "b.png"]])
    _, rows = planned_rows(uri)

    assert [(g.request.row.id, g.pixels, g.error) for g in _generate_on_a_text_model(rows, 1)] == [
        ("0", None, "2 source images; the model takes at most 1 per row")
    ]


def _generate_on_a_text_model(rows, max_sources: int | None = None) -> list:
    """The rows' images through the text-to-image tiny model: handed a row with sources, it
    would refuse them (raise), so only rows failed before the pipeline come back."""
    generator = BatchGenerator(load_pipeline("tiny"), max_sources=max_sources)
    generator.sources = SourcePrefetch(SourceReader(EDIT.source_limits))
    try:
        return list(iter_generated(generator, plan_batches(image_requests(rows), 4)))
    finally:
        generator.sources.close()


def test_batches_group_sources_by_the_size_this_pipeline_encodes_them_at(tmp_path):
    """A checkpoint may encode its sources at its own area (the tiny edit model at its buckets'
    128 x 128): two sources that share a size at the default 1024 x 1024 area but not at the
    model's would make one batch the pipeline refuses, so the batches follow the pipeline's own."""
    write_image(tmp_path / "a.png", 60, 76)
    write_image(tmp_path / "b.png", 68, 86)
    uri = write_input(tmp_path / "p.parquet", [["a.png"], ["b.png"]], width=[32] * 2, height=[32] * 2)
    _, rows = planned_rows(uri)
    assert source_size(60, 76) == source_size(68, 86)  # the family default cannot tell them apart
    generator = BatchGenerator(load_pipeline("tiny-edit", "cpu"))
    assert generator.source_size(60, 76) != generator.source_size(68, 86)
    batches = plan_batches(image_requests(rows), batch_size=8, source_size_of=generator.source_size)
    assert [[r.row.id for r in b] for b in batches] == [["0"], ["1"]]
