"""What `pip install` gives: the `test` extra holds every third-party module the tests and the
package import (read from the source with `ast`), apart from the optional backends the tests
check are absent; each extra the README names exists."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = [REPO_ROOT / "tests", REPO_ROOT / "python" / "hybrid_cache", REPO_ROOT / "kernels"]
# Imported only when present, and the tests check that they are absent here.
OPTIONAL = {"flash_attn"}
# Import name -> distribution name, where they differ.
DISTRIBUTIONS: dict[str, str] = {}


def project() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        names.add(name.lower().replace("-", "_"))
    return names


def imported_top_level_modules() -> set[str]:
    local = {"tests"} | {path.stem for path in (REPO_ROOT / "tests").glob("*.py")}
    modules = set()
    for folder in SOURCES:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    modules.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    return {
        name
        for name in modules
        if name not in sys.stdlib_module_names and name not in local and name != "hybrid_cache"
    }


@pytest.mark.skipif(sys.version_info < (3, 10), reason="needs sys.stdlib_module_names (3.10+)")
def test_the_test_extra_installs_everything_the_tests_import():
    metadata = project()
    installed = requirement_names(metadata["dependencies"])
    installed |= requirement_names(metadata["optional-dependencies"]["test"])
    imported = imported_top_level_modules()
    assert {"torch", "transformers", "tokenizers", "triton", "pytest"} <= imported, imported
    missing = {
        name
        for name in imported - OPTIONAL
        if DISTRIBUTIONS.get(name, name).lower() not in installed
    }
    assert not missing, f"add to the test extra in pyproject.toml: {sorted(missing)}"


def test_the_base_install_is_numpy_alone():
    assert requirement_names(project()["dependencies"]) == {"numpy"}


def test_every_extra_the_readme_names_exists():
    extras = set(project()["optional-dependencies"])
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    named = set()
    for group in re.findall(r'pip install "\.\[([a-z,-]+)\]"', readme):
        named.update(group.split(","))
    assert {"engine", "hf", "test"} <= named, named
    assert named <= extras, sorted(named - extras)
