"""The README's code blocks as written, for the tests that run them."""

from __future__ import annotations

import re

from tests.support.paths import REPO

_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def readme_blocks(section: str, language: str = "python") -> list[str]:
    """The `language` blocks of README.md's `## {section}`, in order."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return [code for lang, code in _FENCE.findall(body) if lang == language]
