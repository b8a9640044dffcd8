"""The config files of the published Qwen-Image checkpoints, as the hub ships them (SOURCES.md says
where from): data, read by the self-test at the published widths and by the tests."""

import json
from pathlib import Path

PUBLISHED = Path(__file__).parent


def published_config(model: str, rel: str) -> dict:
    """The JSON file `rel` of published checkpoint `model` ("qwen-image", "transformer/config.json")."""
    return json.loads((PUBLISHED / model / rel).read_text())
