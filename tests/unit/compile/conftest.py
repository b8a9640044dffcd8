"""Each compile test starts from empty Dynamo caches, as a fresh actor process does.

Dynamo keeps compiled code per code object, for every pipeline a process has made, and its
recompile limit (compile.shape_limit) counts them all: after the tests before it had compiled the
same block methods eight times, a test's own warm-up fell back to eager (0 compiles) when the
whole suite ran, though it passed alone.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
