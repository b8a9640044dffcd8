"""Package layout: the layer folders at the top of the repository install as ditfleet.<layer>.

Metadata and dependencies are in pyproject.toml; only the mapping, which needs a walk of the
folders, is here.
"""

from setuptools import find_packages, setup

# model <- compile <- workers <- driver <- jobs (ARCHITECTURE.md); `ditfleet/` is the users' face.
LAYERS = ("model", "compile", "workers", "driver", "jobs")

package_dir = {"ditfleet": "ditfleet"}
# ditfleet.testing: the builders tests/ and bench/ share (random checkpoints, model folders, outputs).
packages = ["ditfleet", "ditfleet.testing"]
for layer in LAYERS:
    package_dir[f"ditfleet.{layer}"] = layer
    packages.append(f"ditfleet.{layer}")
    packages += [f"ditfleet.{layer}.{sub}" for sub in find_packages(where=layer)]

setup(package_dir=package_dir, packages=packages)
