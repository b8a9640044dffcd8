"""ARCHITECTURE.md's rooms name every module of the five layers, and name none that is gone.

The rooms block is a code block of lines `FOLDER/  module.py module.py ...  what they are`: the
first column is the folder (from the repository root), then the modules (`name.py`) and the
subpackages (`name/`, listed in their own lines too) that live there, then words. A module added
without a line, or a line naming a module that was moved or deleted, fails here, so the map a
newcomer reads is the code.
"""

from __future__ import annotations

import re

from tests.support.paths import REPO

LAYERS = ("model", "compile", "workers", "driver", "jobs")
_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.py|/)$")


def _rooms() -> dict[str, set[str]]:
    """Folder -> the entries (module files and subfolders) the rooms block names in it."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    block = text.split("## Rooms", 1)[1].split("```", 2)[1]
    named: dict[str, set[str]] = {}
    for line in block.splitlines():
        if not line.strip() or line.startswith(" "):
            continue
        folder, *rest = line.split()
        for word in rest:
            if not _ENTRY.match(word):
                break  # the description starts
            named.setdefault(folder, set()).add(word)
    return named


def _modules() -> dict[str, set[str]]:
    """Folder -> its modules and subpackages, for every folder of the five layers."""
    found: dict[str, set[str]] = {}
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            rel = path.relative_to(REPO)
            if "__pycache__" in rel.parts or path.name == "__init__.py":
                continue
            folder = rel.parent.as_posix() + "/"
            found.setdefault(folder, set()).add(path.name)
            # Each folder above it, up to the layer, names the subfolder as an entry.
            parts = rel.parent.parts
            for depth in range(1, len(parts)):
                found.setdefault("/".join(parts[:depth]) + "/", set()).add(parts[depth] + "/")
    return found


def test_the_rooms_name_every_module_of_the_layers_and_no_other():
    named, modules = _rooms(), _modules()
    missing = sorted(f"{folder}{m}" for folder, ms in modules.items() for m in ms - named.get(folder, set()))
    gone = sorted(
        f"{folder}{m}"
        for folder, ms in named.items()
        if folder.split("/", 1)[0] in LAYERS
        for m in ms
        if not (REPO / folder / m).exists()
    )
    assert not missing, f"ARCHITECTURE.md's rooms do not name: {missing}"
    assert not gone, f"ARCHITECTURE.md's rooms name what is not there: {gone}"


def test_the_walk_of_a_prompt_names_only_files_that_exist():
    text = (REPO / "ARCHITECTURE.md").read_text()
    walk = text.split("## One prompt, end to end", 1)[1]
    paths = set(re.findall(r"`((?:model|compile|workers|driver|jobs)/[A-Za-z0-9_/]+\.py)", walk))
    assert paths, "the walk names no module"
    assert not sorted(p for p in paths if not (REPO / p).is_file()), "the walk names files that are gone"
