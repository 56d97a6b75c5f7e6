"""The kernels ship inside the wheel as `hybrid_cache.kernels` (cheap checks, no wheel build).

Scheme: the sources live in the top-level `kernels/` folder; `python/hybrid_cache/kernels` is a
symlink to it; `[tool.maturin] include` lists the kernel files through the symlink because
maturin does not walk into symlinked folders of python-source by itself.
"""

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

import hybrid_cache.errors
import hybrid_cache.kernels
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ["errors", "reference", "_launch", "paged_attention", "cache_write"]


def maturin_config() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["tool"]["maturin"]


def include_patterns(archive: str) -> list:
    patterns = []
    for entry in maturin_config().get("include", []):
        if isinstance(entry, str):
            patterns.append(entry)
            continue
        formats = entry["format"] if isinstance(entry["format"], list) else [entry["format"]]
        if archive in formats:
            patterns.append(entry["path"])
    return patterns


def test_kernel_modules_are_found_in_the_package():
    # find_spec, not import: importing the Triton modules here would decorate the kernels
    # before tests/test_kernels.py sets TRITON_INTERPRET=1.
    package_dir = Path(hybrid_cache.kernels.__file__).parent
    for name in KERNEL_MODULES:
        spec = importlib.util.find_spec(f"hybrid_cache.kernels.{name}")
        assert spec is not None, f"hybrid_cache.kernels.{name} is missing"
        assert Path(spec.origin).parent == package_dir
    assert {"unified_attention", "write_kv_cache"} <= set(hybrid_cache.kernels.__all__)
    assert hybrid_cache.errors.KernelArgumentError is hybrid_cache.kernels.KernelArgumentError


def test_importing_the_package_needs_neither_torch_nor_triton():
    # The kernels package imports hybrid_cache.errors for KernelArgumentError; torch is an
    # optional extra.
    code = (
        "import sys; import hybrid_cache.kernels as k; "
        "assert issubclass(k.KernelArgumentError, ValueError); "
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, "
        "sorted(m for m in ('torch', 'triton') if m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT.parent)


def test_package_symlink_points_at_the_top_level_kernels_folder():
    link = REPO_ROOT / "python" / "hybrid_cache" / "kernels"
    assert link.is_symlink(), f"{link} should be a symlink to ../../kernels"
    assert link.resolve() == (REPO_ROOT / "kernels").resolve()


@pytest.mark.parametrize("archive", ["wheel", "sdist"])
def test_maturin_include_puts_every_kernel_file_into_the_archive(archive):
    config = maturin_config()
    python_source = (REPO_ROOT / config["python-source"]).resolve()
    shipped = set()
    for pattern in include_patterns(archive):
        # glob follows symlinked folders, as maturin's include globbing does.
        for path in glob.glob(str(REPO_ROOT / pattern), recursive=True):
            if os.path.isfile(path):
                shipped.add(Path(os.path.relpath(path, python_source)).as_posix())
    sources = {
        f"hybrid_cache/kernels/{path.relative_to(REPO_ROOT / 'kernels').as_posix()}"
        for path in (REPO_ROOT / "kernels").rglob("*")
        if path.is_file()
        and (path.suffix == ".py" or path.name == "README.md")
        and "__pycache__" not in path.parts
    }
    assert "hybrid_cache/kernels/paged_attention.py" in sources
    missing = sources - shipped
    assert not missing, f"kernel files the {archive} would lack: {sorted(missing)}"
    stray = {path for path in shipped if path.endswith(".pyc")}
    assert not stray, f"bytecode the {archive} would carry: {sorted(stray)}"
