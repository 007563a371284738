"""Every console script in pyproject.toml prints its --help (argparse formats help strings with
%, so a stray one fails only when a user asks for help)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

SCRIPTS = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help(name, capsys):
    module, _, func = SCRIPTS[name].partition(":")
    with pytest.raises(SystemExit) as e:
        getattr(importlib.import_module(module), func)(["--help"])
    assert e.value.code == 0
    assert "usage: " in capsys.readouterr().out
