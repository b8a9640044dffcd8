"""Package layout: the layer folders at the top of the repository install as ditfleet.<layer>.

Metadata and dependencies are in pyproject.toml; only the mapping, which needs a walk of the
folders, is here.
"""

import os

from setuptools import find_packages, setup

# model <- compile <- workers <- driver <- jobs (ARCHITECTURE.md); `ditfleet/` is the users' face.
LAYERS = ("model", "compile", "workers", "driver", "jobs")
# Folders of data files, not code: the bundled tiny models' weights, the published model configs,
# the example job. Each folder is declared a (data-only) package with its files as
# package data: setuptools warns about, and stops including in a later release, data in folders
# that look like packages but are not declared as ones.
DATA = (
    ("model", "tiny/weights"),
    ("model", "tiny/edit_weights"),
    ("model", "qwen_image/published"),
    ("jobs", "examples"),
)

package_dir = {"ditfleet": "ditfleet"}
# ditfleet.testing: the builders tests/ and bench/ share (random checkpoints, model folders, outputs).
packages = ["ditfleet", "ditfleet.testing"]
for layer in LAYERS:
    package_dir[f"ditfleet.{layer}"] = layer
    packages.append(f"ditfleet.{layer}")
    packages += [f"ditfleet.{layer}.{sub}" for sub in find_packages(where=layer)]

package_data = {}
for root, folder in DATA:
    base = f"ditfleet.{root}"
    # followlinks: the edit model's vae/ is a link to the tiny model's (one copy in the repository;
    # an installed package holds the files under both names).
    for here, _dirs, files in os.walk(os.path.join(root, folder), followlinks=True):
        if "__pycache__" in here or not files:
            continue
        name = ".".join([base, *os.path.relpath(here, root).split(os.sep)])
        if name not in packages:
            packages.append(name)
        package_data[name] = [f for f in files if not f.endswith((".py", ".pyc"))]

setup(package_dir=package_dir, packages=packages, package_data=package_data)
