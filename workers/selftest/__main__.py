"""`python -m ditfleet.workers.selftest --out DIR [--tiny]`: see the package docstring."""

from __future__ import annotations

import sys

from ditfleet.workers.selftest.main import main

if __name__ == "__main__":
    sys.exit(main())
