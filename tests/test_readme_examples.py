"""Every ```pycon block of README.md runs as a doctest (each block on its own)."""

from __future__ import annotations

import doctest
import gc
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```pycon[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks():
    text = README.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 2  # the first line inside the block
        out.append(pytest.param(m.group(1), line, id=f"README.md:{line}"))
    return out


BLOCKS = _blocks()


def test_readme_has_the_five_distributed_values_examples():
    assert len(BLOCKS) >= 5
    text = README.read_text(encoding="utf-8")
    assert "## The tf.distribute examples, with distvals" in text


@pytest.mark.parametrize("source,line", BLOCKS)
def test_readme_block(source, line):
    parser = doctest.DocTestParser()
    test = parser.get_doctest(source, {"__name__": "README"}, f"README.md:{line}", str(README), line - 1)
    assert test.examples, "a pycon block without examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    # Strategies made by the examples go now, with their threads.
    for value in list(test.globs.values()):
        close = getattr(value, "close", None)
        if type(value).__name__.endswith("Strategy") and callable(close):
            close()
    test.globs.clear()
    gc.collect()
    assert results.failed == 0, "".join(report)
    assert results.attempted == len(test.examples)
