"""How the bundled models' weights were made. Run from the repository root, e.g.
`python -m recipes.tiny.train --out model/tiny/weights`; recipes import the installed
`ditfleet.model` and nothing above it (tests/unit/test_layering.py)."""
