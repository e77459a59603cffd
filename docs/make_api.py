"""Writes docs/api.md, the API reference, from the docstrings of the installed distvals.

    python docs/make_api.py            # (re)write docs/api.md
    python docs/make_api.py --check    # fail if docs/api.md is stale or a public name has no docstring

The reference lists every public name of ``distvals`` and of its public submodules
(``__all__``), each with its signature and docstring, and the public methods and
properties each class defines. CI runs ``--check`` against the built wheel, so the
committed reference always matches the code and nothing public goes undocumented.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import pathlib
import re
import sys
import types
from typing import Any, Callable, List, Optional, Tuple

MODULES = [
    "distvals",
    "distvals.config",
    "distvals.cuda",
    "distvals.data",
    "distvals.data.experimental",
    "distvals.experimental",
]
OUT = pathlib.Path(__file__).with_name("api.md")


def _doc(obj: Any) -> Optional[str]:
    """The object's own docstring (not one inherited from ``object`` or a builtin)."""
    doc = obj.__doc__ if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, property)) else None
    if isinstance(obj, type) and doc is not None and any(doc is b.__doc__ for b in obj.__mro__[1:]):
        doc = None
    if isinstance(obj, type) and issubclass(obj, enum.Enum) and doc == "An enumeration.":
        doc = None
    return inspect.cleandoc(doc) if doc and doc.strip() else None


def _signature(name: str, obj: Any) -> str:
    """``name(params)``; pybind11 functions carry theirs on the first docstring line."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        text = f"{name}({', '.join(_parameters(sig))}){_returns(sig)}"
        # A sentinel default prints its address, which changes from run to run.
        return re.sub(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", r"<\1 object>", text)
    first = (obj.__doc__ or "").strip().splitlines()
    if first and first[0].startswith(name.rsplit(".", 1)[-1] + "("):
        return name.rsplit(".", 1)[0] + "." + first[0] if "." in name else first[0]
    return f"{name}(...)"


def _annotation(a: Any) -> str:
    # Written as in the source: strings under postponed evaluation, else formatted.
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _parameters(sig: inspect.Signature) -> List[str]:
    """The parameters as written in a def, without private ones (leading underscore)."""
    P = inspect.Parameter
    params = [p for p in sig.parameters.values() if not p.name.startswith("_")]
    out: List[str] = []
    star = any(p.kind is P.VAR_POSITIONAL for p in params)
    for i, p in enumerate(params):
        if p.kind is P.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        text = {P.VAR_POSITIONAL: "*", P.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not P.empty and p.name != "self":
            text += f": {_annotation(p.annotation)}"
        if p.default is not P.empty:
            text += f" = {p.default!r}" if p.annotation is not P.empty else f"={p.default!r}"
        out.append(text)
        if p.kind is P.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not P.POSITIONAL_ONLY):
            out.append("/")
    return out


def _returns(sig: inspect.Signature) -> str:
    a = sig.return_annotation
    return "" if a is inspect.Signature.empty else f" -> {_annotation(a)}"


def _members(cls: type) -> List[Tuple[str, Any]]:
    """Public methods and properties the class itself defines (in source order)."""
    out = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, (property, types.FunctionType, types.BuiltinFunctionType)) or callable(raw):
            out.append((name, raw))
    return out


def _entry(qual: str, obj: Any, missing: List[str], level: int) -> List[str]:
    head = "#" * level
    lines: List[str] = []
    if isinstance(obj, type):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        kind = "exception" if issubclass(obj, BaseException) else "enum" if issubclass(obj, enum.Enum) else "class"
        lines.append(f"{head} {kind} `{qual}`" + (f" ({', '.join(bases)})" if bases else ""))
        if issubclass(obj, enum.Enum):
            lines.append("")
            lines.append("Members: " + ", ".join(f"`{m.name}`" for m in obj))
        elif not issubclass(obj, BaseException):
            lines += ["", "```python", _signature(qual, obj).removesuffix(" -> None"), "```"]
    elif callable(obj):
        lines += [f"{head} `{qual}()`", "", "```python", _signature(qual, obj), "```"]
    else:
        lines.append(f"{head} `{qual}` = `{obj!r}`")
        return lines + [""]
    doc = _doc(obj)
    if doc is None:
        missing.append(qual)
    lines += ["", doc or "*(no docstring)*", ""]
    if isinstance(obj, type) and not issubclass(obj, (BaseException, enum.Enum)):
        for name, member in _members(obj):
            mq = f"{qual}.{name}"
            if isinstance(member, property):
                lines.append(f"- **`{name}`** (property)")
            else:
                lines.append(f"- **`{_signature(name, member)}`**")
            mdoc = _doc(member)
            if mdoc is None:
                missing.append(mq)
            lines.append("")
            lines += ["  " + line if line else "" for line in (mdoc or "*(no docstring)*").splitlines()]
            lines.append("")
    return lines


def render() -> Tuple[str, List[str]]:
    missing: List[str] = []
    lines = [
        "# distvals API reference",
        "",
        "Generated from the docstrings by `python docs/make_api.py` (CI checks it is current).",
        "",
    ]
    for modname in MODULES:
        mod = importlib.import_module(modname)
        lines += [f"## `{modname}`", ""]
        doc = _doc_module(mod)
        if doc:
            lines += [doc, ""]
        names = getattr(mod, "__all__", [])
        for name in sorted(names, key=lambda n: (isinstance(getattr(mod, n), types.ModuleType), n.lower())):
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                lines += [f"### module `{modname}.{name}`", "", f"See `{obj.__name__}` below.", ""]
                continue
            lines += _entry(f"{modname}.{name}", obj, missing, 3)
    return "\n".join(lines).rstrip() + "\n", missing


def _doc_module(mod: types.ModuleType) -> Optional[str]:
    return inspect.cleandoc(mod.__doc__) if mod.__doc__ else None


def main(argv: Optional[List[str]] = None, write: Callable[[str], Any] = OUT.write_text) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if api.md is stale or a docstring is missing")
    args = p.parse_args(argv)
    text, missing = render()
    if args.check:
        problems = []
        if not OUT.exists() or OUT.read_text() != text:
            problems.append(f"{OUT} is not current: run `python docs/make_api.py` and commit it")
        if missing:
            problems.append(f"{len(missing)} public names have no docstring: " + ", ".join(missing))
        for p_ in problems:
            print(f"make_api: {p_}", file=sys.stderr)
        return 1 if problems else 0
    write(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines); {len(missing)} public names without a docstring")
    if missing:
        print("  " + "\n  ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
