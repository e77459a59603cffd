"""What type checkers, editors and help() see: ReplicaGroup's methods, the stubs of the
extension module against its real signatures, and the shipped typing markers."""

from __future__ import annotations

import ast
import importlib.resources
import inspect
import pydoc
import re
import typing

import numpy as np
import pytest

import distvals as dv
from distvals import _core

SINGLE_CALL = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"]
PER_REPLICA = ["replica_" + name for name in SINGLE_CALL]


def test_help_of_replica_group_lists_every_collective_with_its_parameters():
    text = pydoc.render_doc(dv.ReplicaGroup, renderer=pydoc.plaintext)
    # One line per signature (Python 3.13's pydoc wraps a long one, a parameter a line).
    text = re.sub(r"\(\s+", "(", re.sub(r"\s*\n[\s|]*", " ", text))
    for name in SINGLE_CALL:
        assert f"{name}(self, buffers" in text, name
    for name in PER_REPLICA:
        assert f"{name}(self, replica: " in text, name
    for name in ["abort", "reset", "close", "num_replicas", "aborted", "closed"]:
        assert name in text, name


def test_replica_group_defines_every_collective_of_the_engine():
    engine = {n for n in dir(_core.Group) if not n.startswith("_") and callable(getattr(_core.Group, n))}
    wrapper = {n for n, v in vars(dv.ReplicaGroup).items() if inspect.isfunction(v)}
    assert engine - {"cancel"} <= wrapper, sorted(engine - wrapper)
    # Real methods: visible on the class, with resolvable annotations.
    for name in SINGLE_CALL + PER_REPLICA:
        hints = typing.get_type_hints(getattr(dv.ReplicaGroup, name))
        assert "return" in hints, name


def test_per_replica_signatures_match_what_the_engine_accepts():
    g = _core.Group(2)
    try:
        for name in PER_REPLICA:
            want = _runtime_parameters(getattr(g, name).__doc__, name)
            got = [p for p in inspect.signature(getattr(dv.ReplicaGroup, name)).parameters if p != "self"]
            assert got == [p for p, _ in want], (name, got, want)
    finally:
        g.close()


def test_the_wrapper_forwards_every_argument():
    with dv.ReplicaGroup(2) as g:
        xs = [np.array([1.0, 2.0]), np.array([10.0, 20.0])]
        outs = [np.zeros(2), np.zeros(2)]
        g.all_reduce(xs, "max", "direct", outs)
        for r in range(2):
            np.testing.assert_array_equal(outs[r], [10.0, 20.0], err_msg=f"replica {r}")
        np.testing.assert_array_equal(xs[0], [1.0, 2.0])
        g.reduce(xs, 1, "min")
        np.testing.assert_array_equal(xs[1], [1.0, 2.0])
        with pytest.raises(TypeError, match="stream= applies to GPU replicas"):
            g.broadcast(xs, stream=0)


def _split_top_level(params: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _runtime_parameters(doc: str, name: str) -> list[tuple[str, bool]]:
    """(name, has default) of each parameter, from the signature pybind11 (or the
    binding's own documentation line) writes at the top of the docstring."""
    lines = [line for line in (doc or "").splitlines() if line.startswith(name + "(")]
    # Functions that take *args, **kwargs document their real parameters on a later line.
    real = [line for line in lines if "*args" not in line] or lines
    assert real, f"{name}: no signature in its docstring"
    inner = real[-1][len(name) + 1 :]
    inner = inner[: inner.rindex(")")]
    out = []
    for p in _split_top_level(inner):
        pname = p.split(":")[0].split("=")[0].strip()
        if pname != "self":
            out.append((pname, "=" in p))
    return out


def _signature_doc(runtime, name: str) -> str:
    """The docstring whose first line is the signature: pybind11 writes it there; a
    function defined with the C API carries it in ``__text_signature__`` instead
    ("($module, a, b, /)"), given here in the same form ("name(a, b)")."""
    sig = getattr(runtime, "__text_signature__", None)
    if not sig:
        return runtime.__doc__
    params = [p.strip() for p in sig.strip()[1:-1].split(",")]
    params = [p for p in params if p and p not in ("/", "*") and not p.startswith("$")]
    return f"{name}({', '.join(params)})\n{runtime.__doc__ or ''}"


def _stub_functions(path: str):
    """(owner, function node) of every function in a stub, owner None at module level."""
    tree = ast.parse(importlib.resources.files("distvals").joinpath(path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                is_property = isinstance(item, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list
                )
                if isinstance(item, ast.FunctionDef) and not is_property and item.name != "__init__":
                    yield node.name, item


def _stub_cases():
    cases = [("_core/__init__.pyi", _core)]
    if getattr(_core, "cuda", None) is not None:
        cases.append(("_core/cuda.pyi", _core.cuda))
    for path, module in cases:
        for owner, fn in _stub_functions(path):
            yield pytest.param(module, owner, fn, id=f"{module.__name__}.{owner + '.' if owner else ''}{fn.name}")


@pytest.mark.parametrize("module, owner, fn", list(_stub_cases()))
def test_stub_parameters_match_the_extension(module, owner, fn):
    runtime = getattr(getattr(module, owner) if owner else module, fn.name)
    want = _runtime_parameters(_signature_doc(runtime, fn.name), fn.name)
    args = fn.args
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg != "self"]
    positional = args.posonlyargs + args.args
    defaults = {a.arg for a in positional[len(positional) - len(args.defaults) :]}
    defaults |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    got = [(p, p in defaults) for p in params]
    assert got == want, f"stub {got} vs extension {want}"


def test_the_package_ships_its_typing_markers():
    root = importlib.resources.files("distvals")
    assert root.joinpath("py.typed").is_file()
    assert root.joinpath("_core/__init__.pyi").is_file()
    assert root.joinpath("_core/cuda.pyi").is_file()
