"""Prints the requirements the image installs, one a line, from pyproject.toml (the one source).

  requirements.py PYPROJECT            kvpilot's dependencies and its `operator` extra
  requirements.py PYPROJECT --build    what building kvpilot's wheel needs ([build-system] requires)

Used by the Containerfile (dependencies before sources, for the layer cache) and by
hack/image/build.sh (the wheelhouse). Standard library only: it runs on the bare base image.
"""

import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    pyproject = tomllib.load(f)
if sys.argv[2:] == ["--build"]:
    print(*pyproject["build-system"]["requires"], sep="\n")
else:
    project = pyproject["project"]
    print(*project["dependencies"], *project["optional-dependencies"]["operator"], sep="\n")
