"""``python -m distvals --cmake-dir``: where the installed CMake package lives."""

import argparse
import os
import sys


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(prog="python -m distvals", description=__doc__)
    p.add_argument("--cmake-dir", action="store_true", help="print the directory holding distvalsConfig.cmake")
    p.add_argument("--prefix", action="store_true", help="print the install prefix (for CMAKE_PREFIX_PATH)")
    p.add_argument("--include-dir", action="store_true", help="print the C++ include directory")
    p.add_argument("--version", action="store_true")
    a = p.parse_args(argv)
    if a.cmake_dir:
        print(os.path.join(here, "lib", "cmake", "distvals"))
    elif a.prefix:
        print(here)
    elif a.include_dir:
        print(os.path.join(here, "include"))
    else:
        from . import __version__
        print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
