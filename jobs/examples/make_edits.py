"""Write jobs/examples/edits.parquet: 24 edits of the tiny model's own scenes, for the edit job.

    python jobs/examples/make_edits.py [--out jobs/examples/edits.parquet]

Each row is one source picture and one instruction for the bundled edit model (`model.path:
tiny-edit`): the first 24 of its held-out edits (model.tiny.edits: scenes neither tiny model
trained on, each with an instruction such as "make the shape blue" or "move the shape to the top
left"). The source is the scene drawn by the scenes' own renderer, a PNG embedded in the row as
the Hugging Face `datasets` image struct {bytes, path}; a third of them are landscape (160x96)
or portrait (96x160), so the job keeps each one's aspect ratio. `scene` and `edit` pass through
to the manifests. Same pixels on every run.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ditfleet.jobs.examples.make_prompts import write_example  # noqa: E402
from ditfleet.model.tiny.edit_adherence import source_pixels  # noqa: E402
from ditfleet.model.tiny.edits import held_out_edits  # noqa: E402

ROWS = 24
SIZES = [(128, 128), (160, 96), (96, 160)]  # (width, height): the tiny models' buckets
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image() feature


def _png(pixels) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def edits_table(rows: int = ROWS) -> pa.Table:
    pairs = held_out_edits()[:rows]
    images = []
    for i, pair in enumerate(pairs):
        width, height = SIZES[i % len(SIZES)]
        images.append({"bytes": _png(source_pixels([pair], width, height)[0]), "path": f"source-{i:03d}.png"})
    return pa.table(
        {
            "id": [f"edit-{i:03d}" for i in range(len(pairs))],
            "prompt": [edit.instruction for _, edit in pairs],
            "image": pa.array(images, IMAGE),
            "scene": [scene.caption for scene, _ in pairs],
            "edit": [edit.attribute for _, edit in pairs],
        }
    )


def main() -> None:
    write_example(edits_table(), "edits.parquet", __doc__.splitlines()[0], "edits")


if __name__ == "__main__":
    main()
