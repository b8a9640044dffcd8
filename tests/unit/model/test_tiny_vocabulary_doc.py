"""docs/tiny-model.md lists the tiny model's vocabulary as the code has it: the caption template's
words (model/tiny/scenes.py) and its tokenizer's words, so the page cannot drift from the model."""

from __future__ import annotations

from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.model.tiny.known_words import vocabulary
from ditfleet.model.tiny.scenes import COLORS, POSITION_PHRASES, POSITIONS, SHAPES, SIZES, Scene
from tests.support.paths import REPO


def test_the_tiny_model_page_lists_the_vocabulary_the_code_has():
    expected = [
        f"- sizes: {', '.join(SIZES)}",
        f"- colours (shape and background): {', '.join(COLORS)}",
        f"- shapes: {', '.join(SHAPES)}",
        f"- positions: {', '.join(POSITION_PHRASES[p] for p in POSITIONS)}",
        "- its tokenizer's words (`model/tiny/weights/tokenizer/vocab.json`): "
        + ", ".join(sorted(vocabulary(str(TINY_MODEL_DIR)))),
    ]
    page = (REPO / "docs" / "tiny-model.md").read_text()
    block = "\n".join(expected)
    assert block in page, f"docs/tiny-model.md's vocabulary list should read:\n{block}"
    # The template the page states is the one captions are made from.
    scene = Scene(shape="circle", size="small", color="red", position="centre", background="blue")
    assert scene.caption == "a small red circle in the centre on a blue background"
    assert '"a SIZE COLOUR SHAPE POSITION on a COLOUR background"' in " ".join(page.split())
