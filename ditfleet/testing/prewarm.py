"""`python -m ditfleet.compile.prewarm` in a child process: what the shared compile cache saves a
fresh process (the compile tests and bench/vae_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def spawn_prewarm(
    model: str | Path,
    buckets: Sequence[str],
    store_dir: str | Path,
    inductor_cache_dir: str | Path,
    device: str = "cpu",
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 900,
) -> dict[str, Any]:
    """Run `prewarm` in a fresh Python process with its own local Inductor cache directory.

    Only that child's environment changes (TORCHINDUCTOR_CACHE_DIR, plus extra_env), so the
    child starts with empty local caches and only the shared store can spare it a compile.
    """
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir), **(extra_env or {})}
    cmd = [
        sys.executable, "-m", "ditfleet.compile.prewarm", "--model", str(model), "--buckets", ",".join(buckets),
        "--store", str(store_dir), "--device", device,
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"prewarm child failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])
