"""A whole `ditfleet run` of a toy FLUX checkpoint (built here with diffusers' own classes, nothing
downloaded) under a real local Ray: every image bitwise what diffusers' FluxPipeline makes with
the same seed, `verify` clean, and an actor killed mid-job gives every row exactly once; and a
whole edit job on a toy SD3 image-to-image checkpoint, every image bitwise diffusers' own."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ditfleet.jobs.cli import main
from ditfleet.testing.diffusers_models import make_flux_dir, make_sd3_dir
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.integration.test_end_to_end import _kill_writers_of_new_manifests, write_job
from tests.support.worker_fixtures import write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

BATCH = 2


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory) -> Path:
    return make_flux_dir(tmp_path_factory.mktemp("flux") / "model")


@pytest.fixture(scope="session")
def reference(flux_dir):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _expected(pipe, prompt: str, seed: int, width: int, height: int) -> np.ndarray:
    """diffusers' own call at the actor's batch shape (each image its own generator), with the
    defaults the job resolves where it sets none: FluxPipeline.__call__'s (guidance_scale 3.5,
    distilled guidance, no negative; 512 text tokens), the job's 2 steps."""
    images = pipe(
        prompt=[prompt] * BATCH, height=height, width=width, num_inference_steps=2, guidance_scale=3.5,
        max_sequence_length=512,
        generator=[torch.Generator().manual_seed(seed) for _ in range(BATCH)], output_type="pt",
    ).images  # fmt: skip
    return (images[0] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def _check_images(out: Path, prompts: Path, pipe) -> None:
    store = open_store(str(out))
    table = read_manifests(store).to_pylist()
    source = {r["id"]: r for r in pq.read_table(prompts).to_pylist()}
    assert sorted(r["id"] for r in table) == sorted(source), "every row exactly once"
    for row in table:
        assert row["status"] == "ok"
        got = np.asarray(Image.open(io.BytesIO(store.get(row["uri"][len(store.uri()) :].lstrip("/")))))
        want = _expected(pipe, source[row["id"]]["prompt"], row["seed"], row["width"], row["height"])
        assert np.array_equal(got, want), f"row {row['id']}: not diffusers' image"


def _job(tmp_path: Path, flux_dir: Path, prompts: Path, out: Path, workers: int, shards: int) -> Path:
    return write_job(
        tmp_path / "job.yaml", flux_dir, prompts, str(out),
        workers=f"{{min: {workers}, max: {workers}, gpus: 0, cpus: 1, batch_size: {BATCH}, idle_retire_s: 2}}",
        shards=f"{{size: {shards}}}", compile="{vae: false, dit: false}",
    )  # fmt: skip


def test_flux_job_is_diffusers_bitwise_and_verifies(flux_dir, reference, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.parquet", 9)
    out = tmp_path / "out"
    assert main(["run", str(_job(tmp_path, flux_dir, prompts, out, 1, 5))]) == 0, capsys.readouterr().err
    _check_images(out, prompts, reference)
    assert main(["verify", str(out)]) == 0, capsys.readouterr().err


def test_flux_actor_killed_mid_job_rerun_exactly_once(flux_dir, reference, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.parquet", 16)
    out = tmp_path / "out"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_writers_of_new_manifests, args=(out, 1, 1, killed), daemon=True)
    killer.start()
    code = main(["run", str(_job(tmp_path, flux_dir, prompts, out, 2, 2))])
    killer.join(timeout=10)
    err = capsys.readouterr().err
    assert len(killed) == 1 and code == 0, err
    assert "lost (actor_died)" in err
    _check_images(out, prompts, reference)
    assert main(["verify", str(out)]) == 0, capsys.readouterr().err


@pytest.fixture(scope="session")
def img2img_dir(tmp_path_factory) -> Path:
    return make_sd3_dir(tmp_path_factory.mktemp("sd3-img2img") / "model", img2img=True)


def _edit_input(folder: Path, n: int) -> Path:
    """n rows, each naming one PNG source by a path relative to the Parquet (landscape and
    portrait, random pixels), the instruction as the prompt."""
    (folder / "img").mkdir(parents=True)
    for i in range(n):
        w, h = (48, 32) if i % 2 else (32, 48)
        pixels = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").save(folder / "img" / f"{i}.png")
    colours = ("red", "green", "blue", "yellow")
    pq.write_table(
        pa.table(
            {
                "id": [f"e{i:03d}" for i in range(n)],
                "prompt": [f"make the shape {colours[i % 4]}" for i in range(n)],
                "image": [f"img/{i}.png" for i in range(n)],
            }
        ),
        folder / "edits.parquet",
    )
    return folder / "edits.parquet"


def test_an_image_to_image_edit_job_is_diffusers_bitwise_per_row(img2img_dir, tmp_path, capsys):
    """Issue 51 through the diffusers family: a whole edit job on a toy StableDiffusion3Img2ImgPipeline
    (its __call__ takes an image: an edit model), each row's source read by the worker and handed
    to the pipeline's `image`: every image bitwise diffusers' own call on that row (batch size 1,
    the pipeline's own defaults but the job's steps), its manifest row naming its source, `verify` clean."""
    from diffusers import StableDiffusion3Img2ImgPipeline

    edits = _edit_input(tmp_path / "in", 6)
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.yaml", img2img_dir, edits, str(out),
        input=f"{{path: {edits}, image_column: image}}", sampling="{steps: 4, seed: 7}",
        buckets="{names: [48x32, 32x48]}", compile="{vae: false, dit: false}",
        workers="{min: 1, max: 1, gpus: 0, cpus: 1, batch_size: 1, idle_retire_s: 2}", shards="{size: 3}",
    )  # fmt: skip
    assert main(["run", str(job)]) == 0, capsys.readouterr().err
    reference = StableDiffusion3Img2ImgPipeline.from_pretrained(img2img_dir)
    reference.set_progress_bar_config(disable=True)
    store = open_store(str(out))
    rows = read_manifests(store).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"e{i:03d}" for i in range(6)]
    for row in rows:
        i = int(row["id"][1:])
        assert row["status"] == "ok" and row["source_uris"] == [str(tmp_path / "in" / "img" / f"{i}.png")], (
            row
        )
        source = Image.open(tmp_path / "in" / "img" / f"{i}.png").convert("RGB")
        # Its own defaults where the job says none: guidance_scale 7.0 (CFG), 256 text tokens, strength 0.6.
        want = reference(
            prompt=[row["prompt"]], image=[source], height=row["height"], width=row["width"], num_inference_steps=4,
            generator=[torch.Generator().manual_seed(row["seed"])], output_type="pt",
        ).images[0]  # fmt: skip
        want_u8 = (want * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        got = np.asarray(Image.open(io.BytesIO(store.get(row["uri"][len(store.uri()) :].lstrip("/")))))
        assert (row["width"], row["height"]) == source.size, "a source keeps its aspect ratio's bucket"
        assert np.array_equal(got, want_u8), f"row {row['id']}: not diffusers' image"
    assert main(["verify", str(out)]) == 0, capsys.readouterr().err
