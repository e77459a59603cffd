"""``python -m distvals --prefix``: where the installed C++ package lives.

A CMake project finds the distvals shipped in this wheel with::

    cmake -S . -B build -DCMAKE_PREFIX_PATH="$(python -m distvals --prefix)"

and ``find_package(distvals CONFIG REQUIRED)``. Builds driven by scikit-build-core
need none of this: the wheel registers the ``cmake.prefix`` entry point.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable, List, Optional

__all__ = ["main", "package_prefix"]

_CONFIG = os.path.join("lib", "cmake", "distvals", "distvalsConfig.cmake")


def _candidates() -> Iterable[str]:
    # An installed wheel has one package directory; an editable install may list the
    # source directory first and the directory holding the built files after it.
    import distvals

    seen: List[str] = []
    for entry in list(getattr(distvals, "__path__", [])) + [os.path.dirname(os.path.abspath(__file__))]:
        path = os.path.abspath(entry)
        if path not in seen:
            seen.append(path)
            yield path


def package_prefix() -> Optional[str]:
    """The installed package directory that holds ``lib/cmake/distvals``, or None."""
    for path in _candidates():
        if os.path.isfile(os.path.join(path, _CONFIG)):
            return path
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Print the requested directory (or the version); 1 when the C++ package is missing."""
    p = argparse.ArgumentParser(
        prog="python -m distvals", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--cmake-dir", action="store_true", help="print the directory holding distvalsConfig.cmake")
    group.add_argument("--prefix", action="store_true", help="print the install prefix (for CMAKE_PREFIX_PATH)")
    group.add_argument("--include-dir", action="store_true", help="print the C++ include directory")
    group.add_argument("--lib-dir", action="store_true", help="print the directory holding libdistvals")
    group.add_argument("--version", action="store_true", help="print the version of distvals")
    a = p.parse_args(argv)
    if not (a.cmake_dir or a.prefix or a.include_dir or a.lib_dir):
        from . import __version__

        print(__version__)
        return 0
    prefix = package_prefix()
    if prefix is None:
        print(
            "distvals: this installation carries no C++ package (lib/cmake/distvals/distvalsConfig.cmake "
            "not found under " + ", ".join(_candidates()) + ")",
            file=sys.stderr,
        )
        return 1
    if a.cmake_dir:
        print(os.path.join(prefix, "lib", "cmake", "distvals"))
    elif a.prefix:
        print(prefix)
    elif a.include_dir:
        print(os.path.join(prefix, "include"))
    else:
        print(os.path.join(prefix, "lib"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
