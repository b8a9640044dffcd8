"""A tiny-model job's prompts checked against the words the model knows: one line per job that
names the unknown words (docs/tiny-model.md), before any image is made."""

from __future__ import annotations

from ditfleet.driver.run_job import prompt_source
from ditfleet.jobs.spec import JobSpec
from ditfleet.model.loading.folder import BUNDLED_MODELS, TINY_EDIT_MODEL
from ditfleet.model.tiny.known_words import (
    EXAMPLE_CAPTION,
    EXAMPLE_INSTRUCTION,
    unknown_words,
    unknown_words_warning,
    vocabulary,
)


def tiny_words_warning(spec: JobSpec) -> str | None:
    """The warning line for a job of a bundled tiny model (text or edit) whose prompts use words
    it does not know; None for any other model, or when every word is known."""
    if spec.model.path not in BUNDLED_MODELS:
        return None
    known = vocabulary(str(BUNDLED_MODELS[spec.model.path]))
    column = spec.input.prompt_column
    source = prompt_source(spec.to_driver_config())
    words: dict[str, None] = {}
    total = with_unknown = 0
    for file in source.files():
        prompts = source.open(file).read(columns=[column]).column(column).to_pylist()
        for prompt in prompts:
            total += 1
            found = unknown_words([prompt or ""], known)
            with_unknown += bool(found)
            words.update(dict.fromkeys(found))
    example = EXAMPLE_INSTRUCTION if spec.model.path == TINY_EDIT_MODEL else EXAMPLE_CAPTION
    return unknown_words_warning(list(words), with_unknown, total, example) if words else None
