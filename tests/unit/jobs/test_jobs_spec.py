"""The job spec and the `ditfleet` CLI: clear errors naming file, line and key; exit code 2 and
nothing written on bad input; plan, status and preview on real files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from pydantic import BaseModel

from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import JobSpec, SpecError, load_spec, parse_spec
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import job_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import open_store
from tests.support.paths import REPO

EXAMPLE = REPO / "jobs" / "examples" / "tiny.yaml"


def write_job(tmp_path: Path, body: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def minimal(tmp_path: Path, extra: str = "") -> str:
    pq.write_table(
        pa.table({"prompt": ["a small red circle at the top left on a blue background"] * 3}),
        tmp_path / "p.parquet",
    )
    return f"input:\n  path: {tmp_path / 'p.parquet'}\noutput:\n  uri: {tmp_path / 'out'}\n{extra}"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            "workers:\n  min: 1\n  maxx: 4\n",
            ["job.yaml:7: workers.maxx: unknown key (did you mean 'max'?); allowed here: min, max,"],
        ),
        ("workers:\n  min: two\n", ["job.yaml:6: workers.min:", "valid integer", "(got 'two')"]),
        ("sampling:\n  steps: 0\n", ["job.yaml:6: sampling.steps:", "greater than or equal to 1", "(got 0)"]),
        (
            "output_dir: x\n",
            [
                "job.yaml:5: output_dir: unknown key (did you mean 'output'?); allowed here: name, input, output"
            ],
        ),
        ("workers:\n  zzz: 1\n", ["job.yaml:6: workers.zzz: unknown key; allowed here: min, max,"]),
        (
            "sampling:\n  step_cache: {preset: safe, treshold: 0.2}\n",
            ["sampling.step_cache: unknown key(s) ['treshold'] (did you mean 'threshold'?); allowed:"],
        ),
        ("buckets:\n  names: [100x100]\n", ["buckets.names", "not a positive multiple of 16"]),
        ("workers:\n  min: 3\n  max: 2\n", ["workers: max (2) must be >= min (3)"]),
        ("model:\n  dtype: fp16\n", ["model.dtype: Input should be 'auto', 'bf16' or 'fp32' (got 'fp16')"]),
        (
            "model:\n  loras:\n    - path: hf://org/l.safetensors\n",
            [
                "job.yaml:7: model.loras.0.path: 'hf://org/l.safetensors': give s3://bucket/key or a local path"
            ],
        ),
        (
            "model:\n  loras:\n    - path: a.safetensors\n      scale: 20\n",
            ["job.yaml:8: model.loras.0.scale:", "less than or equal to 8", "(got 20)"],
        ),
        ("model:\n  loras:\n    - scale: 1\n", ["job.yaml:7: model.loras.0.path: required, missing"]),
        (
            "model:\n  scheduler_config: hf://org/x\n",
            ["job.yaml:6: model.scheduler_config: 'hf://org/x': give s3://bucket/key or a local path"],
        ),
    ],
)
def test_spec_errors_name_the_file_line_and_key(tmp_path, extra, expected):
    path = write_job(tmp_path, minimal(tmp_path, extra))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = str(err.value)
    for part in expected:
        assert part.replace("job.yaml", str(path)) in text, text


def test_missing_section_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml: 1 problem.*\n  job.yaml: output: required, missing"):
        parse_spec("input: {path: x.parquet}\n", "job.yaml")
    with pytest.raises(SpecError, match=r"job.yaml:2: not valid YAML: found character '\\t'"):
        parse_spec("input:\n\tpath: x\n", "job.yaml")
    with pytest.raises(SpecError, match="job file not found"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match=r"job.json:1: output.uri: Input should be a valid string \(got 3\)"):
        parse_spec('{"input": {"path": "x"}, "output": {"uri": 3}}', "job.json")


def test_every_field_says_why_it_exists():
    def walk(model: type[BaseModel], prefix: str):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, f"{prefix}{name}.")

    walk(JobSpec, "")


def test_example_job_converts_to_consistent_lower_configs(monkeypatch):
    from ditfleet.compile.buckets import BucketSet
    from ditfleet.workers.rows import RowConfig

    monkeypatch.chdir(EXAMPLE.parents[2])
    spec = load_spec(EXAMPLE)
    driver, worker = spec.to_driver_config(), spec.to_worker_config()
    assert driver.output_uri == worker.output_uri == str(EXAMPLE.parents[2] / "out" / "tiny")
    # What jobs/examples/tiny.yaml asks for, as planner and worker must both resolve rows.
    tiny = BucketSet.from_names(["128x128", "160x96", "96x160"], strict=True)
    expected = RowConfig(job_seed=0, buckets=tiny, steps=20, true_cfg_scale=2.0, negative_prompt=" ")
    assert driver.plan.rows == expected and worker.rows == expected
    assert driver.dispatch.num_gpus == 0 and driver.dispatch.max_actors == 2
    resolved = json.loads(driver.resolved_spec)
    assert resolved["input"]["path"].endswith("jobs/examples/prompts.parquet")
    assert resolved["workers"]["gpus"] == 0


def test_a_share_of_a_gpu_is_refused_for_a_gpu_model(tmp_path):
    # Each actor sizes its batch from the whole card and loads a whole DiT: two on one card OOM.
    for gpus in ("0.5", "0.25"):
        job = write_job(
            tmp_path, minimal(tmp_path, f"model:\n  path: /models/qwen\nworkers:\n  gpus: {gpus}\n")
        )
        with pytest.raises(SpecError, match=rf"workers.gpus: {gpus} is a share of a GPU.*workers.gpus: 1"):
            load_spec(job)
    # whole GPUs, no GPU, or a share while the model runs on the CPU: accepted
    for extra in (
        "workers:\n  gpus: 1\n",
        "workers:\n  gpus: 0\n",
        "model:\n  device: cpu\nworkers:\n  gpus: 0.5\n",
    ):
        assert load_spec(write_job(tmp_path, minimal(tmp_path, extra))).workers.gpus is not None


def test_cli_bad_spec_or_input_exits_2_and_writes_nothing(tmp_path, capsys):
    job = write_job(tmp_path, minimal(tmp_path, "workers:\n  mn: 1\n"))
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{job}:6: workers.mn: unknown key" in err
    pq.write_table(pa.table({"prompt": ["ok", None, ""], "steps": [1, 2, -3]}), tmp_path / "p.parquet")
    job = write_job(
        tmp_path, f"input: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: {tmp_path / 'out'}}}\n"
    )
    for command in ("validate", "plan", "run"):
        assert main([command, str(job)]) == 2
        err = capsys.readouterr().err
        assert "row 1, column 'prompt'" in err and "row 2, column 'steps'" in err, err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_invalid_utf8_and_nul_before_any_claim(tmp_path, capsys):
    raw = pa.array([b"a red circle", b"caf\xe9 au lait", b"fine"], pa.binary()).view(pa.string())
    table = pa.table({"prompt": ["a red circle", "a blue\x00 square", "ok"], "id": raw})
    pq.write_table(table, tmp_path / "p.parquet", compression="none")
    job = write_job(
        tmp_path, f"input: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: {tmp_path / 'out'}}}\n"
    )
    for command in ("validate", "plan", "run"):
        assert main([command, str(job)]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'p.parquet'}: row 1, column 'id': value is not valid UTF-8" in err, err
    table = table.set_column(1, "id", pa.array(["a", "b", "c"]))
    pq.write_table(table, tmp_path / "p.parquet")
    assert main(["validate", str(job)]) == 2
    assert "row 1, column 'prompt': prompt holds a NUL character" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_reads_the_prompt_and_id_columns_the_input_section_names(tmp_path, capsys):
    pq.write_table(
        pa.table({"key": ["k1", "k2", "k3"], "caption": ["a red circle"] * 3, "url": ["u"] * 3}),
        tmp_path / "p.parquet",
    )
    out = tmp_path / "out"
    plain = write_job(tmp_path, f"input: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: {out}}}\n")
    assert main(["validate", str(plain)]) == 2
    err = capsys.readouterr().err
    assert "no 'prompt' column (columns: key, caption, url)" in err and "input.prompt_column" in err
    named = write_job(
        tmp_path,
        f"input: {{path: {tmp_path / 'p.parquet'}, prompt_column: caption, id_column: key}}\noutput: {{uri: {out}}}\n",
        "named.yaml",
    )
    assert main(["validate", str(named)]) == 0
    spec = load_spec(named)
    assert (spec.row_config().prompt_column, spec.row_config().id_column) == ("caption", "key")
    assert spec.input.prompt_column == "caption" and load_spec(plain).row_config().prompt_column == "prompt"


def test_cli_plan_prints_shards_and_buckets(tmp_path, capsys):
    pq.write_table(
        pa.table({"prompt": ["a circle"] * 10, "width": pa.array([160] * 4 + [None] * 6, pa.int32()),
                  "height": pa.array([96] * 4 + [None] * 6, pa.int32())}),
        tmp_path / "p.parquet",
    )  # fmt: skip
    job = write_job(
        tmp_path,
        f"input: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: {tmp_path / 'out'}}}\nshards: {{size: 4}}\n",
    )
    assert main(["plan", str(job), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == 10 and info["shards"] == 3 and info["images"] == 10
    assert info["buckets"] == {"128x128": 2, "160x96": 1}
    assert info["images_per_bucket"] == {"128x128": 6, "160x96": 4}
    assert info["step_cache"] == {"setting": "off", "most_work_saved": 0.0, "line": "off (exact)"}
    assert main(["plan", str(job)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert "rows:    10, images: 10, in 3 shards of up to 4 rows" in text
    assert "buckets: 128x128 6 images, 160x96 4 images" in text
    assert (
        sum(" shards " in line.split(":", 1)[-1] for line in text if not line.startswith(("input", "output")))
        == 1
    ), text


def test_cli_plan_shows_the_step_cache_as_the_model_runs_it(tmp_path, capsys):
    body = minimal(tmp_path, "sampling: {steps: 50, step_cache: safe}\n")
    assert main(["plan", str(write_job(tmp_path, body))]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step cache:")]
    assert line.startswith("step cache: dbcache, threshold 0.12, compute_blocks 1 of 4, warm-up 8 steps")
    # 50 steps, 8 warm-up and 1 exact last: 41 reusable, each skipping 3 of the tiny model's 4 blocks.
    assert f"at most {41 / 50 * 3 / 4:.0%} of the DiT work saved at 50 steps" in line
    assert "measure with `ditfleet calibrate" in line


def _fake_output(root: Path, shards: int, planned: int) -> None:
    """An output as the worker writes it: PNG objects, manifests, and a _job.json."""
    store = open_store(str(root))
    for shard in range(shards):
        writer = ManifestWriter(shard, expected_rows=2)
        for k, colour in enumerate(("red", "blue")):
            row_id = f"s{shard}-{k}"
            buf = io.BytesIO()
            Image.new("RGB", (64, 48), colour).save(buf, format="PNG")
            stored = put_image(
                store, image_key(shard, "a0-00000000000000ff", row_id, None, "png"), buf.getvalue()
            )
            ok = not (shard == 0 and k == 1)
            writer.add(
                manifest_row(
                    row_id,
                    shard,
                    stored if ok else None,
                    error=None if ok else "boom",
                    prompt=f"a {colour} picture number {shard}",
                    height=48,
                    bucket="64x48",
                    worker="w",
                )
            )
        writer.commit(store)
    store.put(job_key(), json.dumps({"fingerprint": "f", "plan": {"shards": planned, "rows": 2 * planned,
                                                                   "images": 2 * planned}}).encode())  # fmt: skip


def test_cli_status_and_preview_read_the_output(tmp_path, capsys):
    out = tmp_path / "out"
    _fake_output(out, shards=2, planned=3)
    assert main(["status", str(out)]) == 1, "incomplete output"
    text = capsys.readouterr().out
    assert "shards: 2 committed of 3, 1 left" in text and "rows:   3 ok, 1 failed" in text
    assert "shards left: 2" in text and "failed x1: boom" in text
    assert main(["status", str(out), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["images"] == {"planned": 6, "ok": 3, "failed": 1}

    sheet = tmp_path / "sheet.png"
    assert main(["preview", str(out), "--out", str(sheet), "--columns", "3"]) == 0
    assert "3 images" in capsys.readouterr().out
    image = Image.open(sheet)
    assert image.format == "PNG" and image.width == 3 * 176 and image.height > 176
    # The first cell shows the red image.
    assert image.getpixel((8 + 80, 8 + 80)) == (255, 0, 0)

    assert main(["preview", str(tmp_path / "empty"), "--out", str(sheet)]) == 2
    assert "no committed ok images" in capsys.readouterr().err


def test_preview_and_report_write_into_a_local_output_by_default(tmp_path, capsys, monkeypatch):
    # Before: the README's commands wrote sheet.png and report.html into the current directory.
    out = tmp_path / "out"
    _fake_output(out, shards=2, planned=2)
    monkeypatch.chdir(tmp_path)
    assert main(["preview", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out / 'sheet.png'}: 3 images")
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out / 'report.html'}: report of {out}")
    assert Image.open(out / "sheet.png").format == "PNG"
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside the output


@pytest.mark.parametrize("output_format", ["files", "parquet", "webdataset"])
def test_preview_reads_every_output_format(tmp_path, output_format, capsys):
    import numpy as np

    from ditfleet.workers.output.formats import ImageTask, ShardWriterConfig, make_shard_writer

    out = tmp_path / "out"
    store = open_store(str(out))
    colours = {"a": (255, 0, 0), "b.c": (0, 0, 255), "d": (0, 255, 0)}
    writer = make_shard_writer(
        store, 0, ShardWriterConfig(output_format=output_format, threads=2), new_attempt_token(0)
    )
    for row_id, colour in colours.items():
        writer.add(ImageTask(id=row_id, prompt=f"a {row_id} square"), np.full((32, 48, 3), colour, np.uint8))
    stored = writer.finish()
    manifest = ManifestWriter(0, expected_rows=3)
    for r in stored.results:
        manifest.add(
            manifest_row(
                r.id,
                0,
                (r.uri, r.sha256, r.bytes),
                k=r.k,
                prompt=f"a {r.id} square",
                width=48,
                height=32,
                bucket="48x32",
                worker="w",
            )  # fmt: skip
        )
    manifest.commit(store)
    sheet = tmp_path / "sheet.png"
    assert main(["preview", str(out), "--out", str(sheet), "--columns", "3"]) == 0, capsys.readouterr().err
    image = Image.open(sheet).convert("RGB")
    # Cells are 176 pixels wide; each image is centred in its 160-pixel thumbnail box.
    for n, colour in enumerate(colours.values()):
        assert image.getpixel((n * 176 + 8 + 80, 8 + 80)) == colour


def test_single_writer_is_explicit_and_excludes_speculative_twins():
    base = "input: {path: p.parquet}\noutput: {uri: s3://b/out}\n"
    assert parse_spec(base).to_driver_config().s3.single_writer is False
    with pytest.raises(SpecError, match="single_writer: true needs workers.speculative_tail: false"):
        parse_spec(base + "s3: {single_writer: true}\n")
    spec = parse_spec(base + "s3: {single_writer: true}\nworkers: {speculative_tail: false}\n")
    assert spec.to_driver_config().s3.single_writer and spec.to_worker_config().s3.single_writer


def test_adapters_and_schedule_are_part_of_the_output_fingerprint(tmp_path):
    """Another LoRA, scale or schedule makes other images: an output refuses to resume with them."""
    from ditfleet.driver.output.job_file import describe_differences
    from ditfleet.driver.plan import settings_doc

    def doc(extra: str = "") -> dict:
        spec = load_spec(write_job(tmp_path, minimal(tmp_path, extra)))
        return settings_doc(spec.to_driver_config().plan)

    plain = doc()
    assert "loras" not in plain["image_settings"]  # outputs planned before adapters keep their fingerprint
    lora = doc("model:\n  loras:\n    - path: a.safetensors\n      scale: 0.5\n")
    stronger = doc("model:\n  loras:\n    - path: a.safetensors\n      scale: 0.6\n")
    lightning = doc("model:\n  scheduler_config: s3://b/lightning/scheduler_config.json\n")
    assert len({json.dumps(d, sort_keys=True) for d in (plain, lora, stronger, lightning)}) == 4
    (change,) = describe_differences(lora, stronger)
    assert change.startswith("image_settings.loras:") and "0.5" in change and "0.6" in change
    assert any(
        c.startswith("image_settings.scheduler_config:") for c in describe_differences(plain, lightning)
    )


def test_embedded_metadata_is_on_by_default_and_part_of_the_output_fingerprint(tmp_path):
    """The images carry their provenance (the job's name included) unless output.embed_metadata
    is false; files with and without it are different bytes, so an output refuses to resume
    across the change. Off, the fingerprint is the one of outputs planned before the knob."""
    from ditfleet.driver.output.job_file import describe_differences
    from ditfleet.driver.plan import settings_doc

    def spec(extra: str = "") -> JobSpec:
        return load_spec(write_job(tmp_path, minimal(tmp_path, extra)))

    on, renamed = spec("name: first\n"), spec("name: second\n")
    off = on.with_changes(output={"embed_metadata": False})
    worker = on.to_worker_config()
    assert worker.writer.embed_metadata is True and worker.job_name == "first"
    assert off.to_worker_config().writer.embed_metadata is False
    assert on.image_settings()["embed_metadata"] is True and on.image_settings()["job_name"] == "first"
    assert not {"embed_metadata", "job_name"} & set(off.image_settings())
    docs = [settings_doc(s.to_driver_config().plan) for s in (on, renamed, off)]
    assert describe_differences(docs[0], docs[1]) == [
        "image_settings.job_name: 'first' in the existing output, 'second' now"
    ]
    assert "image_settings.embed_metadata: True in the existing output, None now" in describe_differences(
        docs[0], docs[2]
    )
    with pytest.raises(SpecError, match="output.embed_metadata"):
        parse_spec("input: {path: p.parquet}\noutput: {uri: out, embed_metadata: maybe}\n")


def test_a_spec_changed_in_code_is_a_validated_copy(tmp_path):
    spec = load_spec(write_job(tmp_path, minimal(tmp_path, "sampling:\n  steps: 20\n  seed: 3\n")))
    changed = spec.with_changes(name="short", sampling={"steps": 10}, output={"uri": str(tmp_path / "o2")})
    assert (changed.name, changed.sampling.steps, changed.sampling.seed) == ("short", 10, 3)
    assert changed.output.uri == str(tmp_path / "o2") and changed.input == spec.input
    assert spec.sampling.steps == 20 and spec.name is None, "the original is left as it was"
    with pytest.raises(SpecError, match=r"sampling.stepz: unknown key \(did you mean 'steps'\?\)"):
        spec.with_changes(sampling={"stepz": 3})
    with pytest.raises(SpecError, match=r"workers.min: Input should be greater than or equal to 1 \(got 0\)"):
        spec.with_changes(workers={"min": 0})
    with pytest.raises(TypeError, match=r"SamplingSpec.steps: a JobSpec is frozen; .*spec.with_changes"):
        spec.sampling.steps = 3
