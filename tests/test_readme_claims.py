"""Every test README.md names exists: a promise that points at a test must point at a
real one. References are written `file.py::test_name` (a file under tests/, found by
its path or its name) or, for the C++ fault tests, F: "test name" with the legend
F = `cpp/tests/test_faults.cpp`."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TESTS = ROOT / "tests"

_PY_REF = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.py)::(\w+)")
_CPP_REF = re.compile(r'F: "([^"]+)"')
_LEGEND_ONLY = re.compile(r"(?<![\w/.])[A-Z]::(test_\w+)")


def _test_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _find(file: str) -> list[pathlib.Path]:
    direct = ROOT / file
    if direct.is_file():
        return [direct]
    return sorted(TESTS.rglob(pathlib.Path(file).name))


def test_every_python_test_named_in_the_readme_exists():
    text = README.read_text(encoding="utf-8")
    refs = _PY_REF.findall(text)
    assert len(refs) >= 20, "README names its tests as file.py::test_name"
    missing = []
    for file, name in refs:
        paths = _find(file)
        if not paths:
            missing.append(f"{file}::{name} (no such file)")
        elif not any(name in _test_names(p) for p in paths):
            missing.append(f"{file}::{name}")
    assert not missing, "README names tests that do not exist: " + ", ".join(missing)


def test_every_cpp_fault_test_named_in_the_readme_exists():
    text = README.read_text(encoding="utf-8")
    faults = (ROOT / "cpp" / "tests" / "test_faults.cpp").read_text(encoding="utf-8")
    refs = _CPP_REF.findall(text)
    missing = [r for r in (" ".join(x.split()) for x in refs) if f'"{r}"' not in faults]
    assert not missing, f"README names C++ tests that do not exist: {missing}"


def test_no_test_is_named_without_its_file_and_no_placeholder_is_left():
    text = README.read_text(encoding="utf-8")
    assert not _LEGEND_ONLY.findall(text), "write test references as file.py::test_name"
    assert "@@" not in text, "a figure placeholder is left in README.md"
    assert "xfail" not in text.lower() or "xfail_strict" in text, "README mentions xfail tests"
