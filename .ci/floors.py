"""Print ``name==floor`` for the ranges .ci/run-versions installs at their floor, from pyproject.toml.

The floor is the ``>=`` bound of each package's requirement in ``dependencies`` or an extra; a package
named here without one is an error (the metadata must say what it was tested with).
"""

import re
import sys

import tomllib

PACKAGES = ("transformers", "peft", "trl", "accelerate")

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in project["optional-dependencies"].values():
    requirements += extra
for name in PACKAGES:
    floors = {
        match.group(1)
        for requirement in requirements
        if (match := re.match(rf"{name}\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", requirement))
    }
    if len(floors) != 1:
        sys.exit(f"pyproject.toml must give {name} one floor (>=), found {sorted(floors) or 'none'}")
    print(f"{name}=={floors.pop()}")
