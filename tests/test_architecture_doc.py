"""docs/ARCHITECTURE.md lists every source file.

Rule: a *source file* is any file ending in `.py`, `.pyi` or `.rs` under `python/hybrid_cache/`,
`rust/<crate>/src/` or `kernels/` (symlinks and `__pycache__` skipped, so the
`python/hybrid_cache/kernels` link to `kernels/` counts once, as `kernels/`). It is *mentioned*
when its path relative to the repository root, with forward slashes, appears in
docs/ARCHITECTURE.md as a whole path: not preceded or followed by a letter, digit, `_`, `-`, `.`
or `/` (so `kernels/errors.py` inside `python/hybrid_cache/kernels/errors.py` would not count). Data files (the presets'
JSON, `py.typed`, `kernels/README.md`) are not source files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SUFFIXES = (".py", ".pyi", ".rs")


def source_files() -> list[str]:
    roots = [ROOT / "python" / "hybrid_cache", ROOT / "kernels"]
    roots += sorted(
        crate / "src" for crate in (ROOT / "rust").iterdir() if (crate / "src").is_dir()
    )
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs[:] = [
                d for d in dirs if d != "__pycache__" and not (Path(folder) / d).is_symlink()
            ]
            for name in files:
                path = Path(folder) / name
                if name.endswith(SUFFIXES) and not path.is_symlink():
                    found.append(path.relative_to(ROOT).as_posix())
    return sorted(found)


def mentioned(path: str, text: str) -> bool:
    return re.search(rf"(?<![\w./-]){re.escape(path)}(?![\w./-])", text) is not None


def test_the_whole_path_must_match():
    assert mentioned("kernels/errors.py", "see `kernels/errors.py`.")
    assert not mentioned("kernels/errors.py", "`python/hybrid_cache/kernels/errors.py`")
    assert not mentioned("rust/core/src/lib.rs", "`rust/core/src/lib.rsx`")


def test_the_walk_finds_the_known_roots():
    files = source_files()
    assert "python/hybrid_cache/engine/kv_cache.py" in files
    assert "rust/core/src/coordinator/mod.rs" in files
    assert "kernels/paged_attention.py" in files
    assert not any(path.startswith("python/hybrid_cache/kernels/") for path in files)


def test_every_source_file_is_in_the_architecture_doc():
    text = DOC.read_text(encoding="utf-8")
    missing = [path for path in source_files() if not mentioned(path, text)]
    assert not missing, (
        "docs/ARCHITECTURE.md does not mention these source files (add each by its path from the "
        "repository root, with a one-line job): " + ", ".join(missing)
    )
