"""The command line as a user meets it: every flag of every subcommand has help text that shows
its default, `--version` answers, and `hybrid-cache plan` runs where only the base install is
(torch, transformers and the rest blocked from import)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest
from hybrid_cache import __version__
from hybrid_cache.cli import build_parser, main


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def test_every_subcommand_is_walked():
    assert set(subcommand_parsers()) == {"plan", "generate", "bench", "bench-serve", "serve"}


@pytest.mark.parametrize("name", sorted(subcommand_parsers()))
def test_every_option_has_help_that_shows_its_default(name):
    parser = subcommand_parsers()[name]
    formatter = parser._get_formatter()
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options, name
    for action in options:
        flag = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"{name} {flag} has no help"
        shown = formatter._expand_help(action)
        default = action.default
        if action.required or default in (None, [], argparse.SUPPRESS):
            continue
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            continue  # a switch: off unless given
        # The formatter's "(default: X)", or the help's own wording of it.
        assert "(default" in shown or "default:" in shown, f"{name} {flag}: no default shown"
    parser.format_help()  # every help string formats (no stray '%')


def test_the_help_of_a_field_flag_shows_the_engine_default():
    text = " ".join(subcommand_parsers()["generate"].format_help().split())
    assert "most requests in one step (default: 256)" in text
    assert "(default: auto)" in text  # --generation-config, --dtype, ...


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"hybrid-cache {__version__}"


# Only what `pip install .` installs may be imported: the standard library, numpy, the package.
BLOCKED = [
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "tqdm",
    "triton",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "pydantic",
    "prometheus_client",
    "httpx",
    "aiohttp",
    "uvloop",
    "httptools",
    "openai",
]
BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ImportError(f"{{name}} is blocked: the base install has no {{name}}")
            return None

    sys.meta_path.insert(0, Blocker())
    from hybrid_cache.cli import main
    code = main(sys.argv[1:])
    loaded = sorted(m for m in {blocked!r} if m in sys.modules)
    assert not loaded, loaded
    sys.exit(code)
    """
).format(blocked=BLOCKED)


def run_without_extras(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, *argv], capture_output=True, text=True, timeout=120
    )


def test_plan_runs_without_torch_or_any_extra():
    done = run_without_extras(
        "plan",
        "--model",
        "gemma-3-27b",
        "--kv-cache-memory",
        "40GiB",
        "--max-model-len",
        "32768",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    concurrency = {
        mode: result[mode]["report"]["max_concurrency"] for mode in ("hybrid", "uniform")
    }
    assert concurrency["hybrid"] > concurrency["uniform"] > 0


def test_the_blocker_does_block():
    """The check above could pass by not blocking: a command that needs torch fails under it."""
    done = run_without_extras(
        "generate", "--model", "tiny-llama", "--kv-cache-memory", "1MiB", "--max-model-len", "64"
    )
    assert done.returncode != 0
    assert "torch is blocked" in done.stderr


@pytest.mark.parametrize("name", ["plan", "generate", "bench"])
def test_every_help_page_works_without_extras(name):
    done = run_without_extras(name, "--help")
    assert done.returncode == 0, done.stderr
    assert f"usage: hybrid-cache {name}" in done.stdout
