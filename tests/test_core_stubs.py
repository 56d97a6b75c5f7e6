"""`_core.pyi` and the compiled extension agree: every class, method and property in the stubs
exists at runtime, and every public runtime member is in the stubs."""

import ast
from pathlib import Path

import pytest
from hybrid_cache import _core

STUBS = Path(_core.__file__).with_name("_core.pyi")
if not STUBS.exists():  # an installed wheel next to the sources
    STUBS = Path(__file__).parents[1] / "python" / "hybrid_cache" / "_core.pyi"


def stub_classes():
    tree = ast.parse(STUBS.read_text())
    classes = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = {
                item.name
                for item in node.body
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")
            }
            members |= {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
            classes[node.name] = members
    return classes


@pytest.mark.parametrize("name", sorted(stub_classes()))
def test_stub_class_matches_runtime(name):
    runtime = getattr(_core, name)
    stubbed = stub_classes()[name]
    public = {member for member in dir(runtime) if not member.startswith("_")}
    if issubclass(runtime, BaseException):
        public -= set(dir(BaseException))
    assert stubbed <= public, f"in the stubs but not at runtime: {stubbed - public}"
    assert public <= stubbed, f"at runtime but not in the stubs: {public - stubbed}"


def test_stub_functions_match_runtime():
    tree = ast.parse(STUBS.read_text())
    stubbed = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    public = {
        name
        for name in dir(_core)
        if not name.startswith("_")
        and callable(getattr(_core, name))
        and not isinstance(getattr(_core, name), type)
    }
    assert stubbed == public, f"stubs {sorted(stubbed)} vs runtime {sorted(public)}"
