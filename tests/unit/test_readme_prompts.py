"""Every prompt the README shows is one the bundled tiny model draws: the README's Python example
runs as written and its image is scored by the model's adherence check; the caption the README
quotes from prompts.parquet is in it; a prompt with unknown words gets one warning line."""

from __future__ import annotations

import logging
import re

import pyarrow.parquet as pq
import pytest

from ditfleet.model.tiny.scenes import parse_caption
from tests.support.paths import REPO

README = (REPO / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _model_example() -> str:
    (block,) = [b for b in _python_blocks() if "load_pipeline" in b and "pipe.generate" in b]
    return block


@pytest.mark.slow
def test_the_readme_model_example_draws_what_its_prompt_says():
    scope: dict = {}
    exec(compile(_model_example(), "README.md (the model alone)", "exec"), scope)  # noqa: S102 - as a user runs it
    images, prompts = scope["images"], re.findall(r'prompt=\[(".*?")\]', _model_example())
    from ditfleet.model.tiny.adherence import score

    captions = [eval(p) for p in prompts]  # noqa: S307 - a string literal of the README
    assert tuple(images.shape) == (1, 3, 128, 128)
    result = score(images, captions)
    assert {k: v for k, v in result.items() if k != "iou"} == {
        "shape_color": 1.0,
        "background": 1.0,
        "position": 1.0,
        "kind": 1.0,
        "size": 1.0,
        "one_blob": 1.0,
    }, (captions, result)
    assert result["iou"] > 0.8, result


def test_every_caption_the_readme_quotes_follows_the_tiny_models_template():
    quoted = re.findall(r'"(a (?:small|large) [a-z ]+ background)"', README)
    assert quoted, "the README quotes captions"
    for caption in quoted:
        parse_caption(caption)  # raises naming the caption and the phrase it does not know


def test_the_example_caption_the_readme_gives_is_in_prompts_parquet():
    (caption,) = re.findall(r'`jobs/examples/prompts.parquet`:\s+captions such as "([^"]+)"', README)
    prompts = pq.read_table(REPO / "jobs" / "examples" / "prompts.parquet").column("prompt").to_pylist()
    assert caption in prompts


@pytest.mark.slow
def test_a_prompt_with_unknown_words_gets_one_line_naming_them(caplog):
    import torch

    from ditfleet import load_pipeline

    pipe = load_pipeline("tiny", device="cpu", dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="ditfleet.model.generation.pipeline"):
        pipe.generate(
            prompt=["a purple dragon in the centre", "a small red circle in the centre on a blue background"],
            height=128,
            width=128,
            steps=1,
            true_cfg_scale=1.0,
            seeds=[0, 1],
        )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("1 of 2 prompts uses words the tiny model does not know ('purple', 'dragon')")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ditfleet.model.generation.pipeline"):
        pipe.generate(
            prompt=["a small red circle in the centre on a blue background"],
            height=128,
            width=128,
            steps=1,
            true_cfg_scale=1.0,
            seeds=[0],
        )
    assert not caplog.records


@pytest.mark.parametrize("job", ["tiny.yaml"])
def test_validate_names_unknown_words_of_a_tiny_job(tmp_path, capsys, job):
    import pyarrow as pa

    from ditfleet.jobs.cli import main

    pq.write_table(
        pa.table({"prompt": ["a small red circle in the centre on a blue background", "a cat"]}),
        tmp_path / "p.parquet",
    )
    path = tmp_path / job
    path.write_text(f"input: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: {tmp_path / 'out'}}}\n")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("warning: 1 of 2 prompts uses words the tiny model does not know ('cat')"), out
