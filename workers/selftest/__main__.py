"""`python -m ditfleet.workers.selftest --out DIR [--tiny]`: see the package docstring."""

from __future__ import annotations

from ditfleet.workers.selftest.main import run_and_exit

if __name__ == "__main__":
    run_and_exit()
