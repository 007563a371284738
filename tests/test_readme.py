"""The README's Python examples are whole programs: each ```python block compiles as a script
(the library example once used a top-level `async with`, which plain `python` refuses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_examples():
    assert BLOCKS


@pytest.mark.parametrize("source", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_each_python_example_compiles_as_a_script(source):
    compile(source, "README.md", "exec")
