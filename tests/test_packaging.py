"""Every package folder of the checkout is in pyproject.toml's packages list: a wheel (and so the image,
which installs one) holds only the packages listed there, while the editable install the tests run
against finds any folder, so a subpackage left out breaks only what users install."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(config["packages"]), config["package-dir"]
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *parts]))
    assert found, "no package folder found: is package-dir still read from pyproject.toml?"
    assert not found - listed, (
        f"package folders missing from pyproject.toml's packages: {sorted(found - listed)}"
    )
    assert not listed - found, f"packages listed without a folder: {sorted(listed - found)}"
