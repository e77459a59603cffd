"""The installed distvals carries a usable C++ package: headers, library, CMake config.

These tests look at the installed ``distvals`` (the wheel's files in site-packages),
never at the source tree, except the slow test that builds ``examples/cpp`` against
the installed package.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

import distvals

IS_LINUX = sys.platform.startswith("linux")
REPO_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpp"
LIB_NAME = "libdistvals.so" if IS_LINUX else ("libdistvals.dylib" if sys.platform == "darwin" else "distvals.dll")


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``python -m distvals ARGS`` in a fresh interpreter, outside the source tree."""
    return subprocess.run(
        [sys.executable, "-m", "distvals", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.expanduser("~") if os.path.isdir(os.path.expanduser("~")) else "/",
    )


def main_path(*args: str) -> Path:
    res = run_main(*args)
    assert res.returncode == 0, f"python -m distvals {' '.join(args)} failed: {res.stderr}"
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one line from python -m distvals {' '.join(args)}, got {res.stdout!r}"
    return Path(lines[0])


@pytest.fixture(scope="module")
def prefix() -> Path:
    return main_path("--prefix")


@pytest.fixture(scope="module")
def cmake_dir() -> Path:
    return main_path("--cmake-dir")


def test_prefix_is_the_imported_package(prefix: Path) -> None:
    pkg_dirs = [Path(p).resolve() for p in distvals.__path__]
    assert prefix.resolve() in pkg_dirs, f"--prefix {prefix} is not a directory of the imported package {pkg_dirs}"


def test_cmake_dir_holds_the_config(prefix: Path, cmake_dir: Path) -> None:
    assert cmake_dir.resolve() == (prefix / "lib" / "cmake" / "distvals").resolve()
    for name in ("distvalsConfig.cmake", "distvalsConfigVersion.cmake", "distvalsTargets.cmake"):
        assert (cmake_dir / name).is_file(), f"{name} missing from {cmake_dir}"
    assert list(cmake_dir.glob("distvalsTargets-*.cmake")), f"no per-configuration targets file in {cmake_dir}"


def test_include_and_lib_dirs(prefix: Path) -> None:
    assert main_path("--include-dir").resolve() == (prefix / "include").resolve()
    assert main_path("--lib-dir").resolve() == (prefix / "lib").resolve()


def test_version_everywhere_agrees(prefix: Path, cmake_dir: Path) -> None:
    res = run_main("--version")
    assert res.returncode == 0 and res.stdout.strip() == distvals.__version__
    header = (prefix / "include" / "distvals" / "version.hpp").read_text()
    m = re.search(r'#define DISTVALS_VERSION_STRING "([^"]+)"', header)
    assert m and m.group(1) == distvals.__version__, f"version.hpp says {m and m.group(1)}"
    cfg = (cmake_dir / "distvalsConfigVersion.cmake").read_text()
    m = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', cfg)
    assert m and m.group(1) == distvals.__version__, f"distvalsConfigVersion.cmake says {m and m.group(1)}"


def included_headers(header: Path) -> List[str]:
    return re.findall(r'#include\s+"(distvals/[^"]+)"', header.read_text())


def test_headers_are_complete_and_python_free(prefix: Path) -> None:
    inc = prefix / "include"
    top = inc / "distvals" / "distvals.hpp"
    assert top.is_file()
    # Every header reachable from the umbrella header is installed.
    todo, seen = ["distvals/distvals.hpp"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = inc / name
        assert path.is_file(), f"{name} is included but not installed"
        todo.extend(included_headers(path))
    for expected in ("group.hpp", "buffer.hpp", "dtype.hpp", "error.hpp", "version.hpp", "config.hpp"):
        assert f"distvals/{expected}" in seen, f"distvals.hpp does not reach {expected}"
    for path in inc.rglob("*.hpp"):
        assert "Python.h" not in path.read_text(), f"{path} mentions Python.h"
    assert not list(inc.rglob("*.in")), "templates (*.in) were installed instead of generated headers"


def test_library_is_in_the_package_once(prefix: Path) -> None:
    lib = prefix / "lib" / LIB_NAME
    assert lib.is_file(), f"{lib} missing"
    copies = [p.name for p in (prefix / "lib").iterdir() if p.name.startswith("libdistvals")]
    assert copies == [LIB_NAME], f"expected one library file, found {copies}"


def imported_location(cmake_dir: Path) -> Path:
    """Where the installed targets file says libdistvals is, resolved like CMake does."""
    targets = (cmake_dir / "distvalsTargets.cmake").read_text()
    ups = len(re.findall(r'get_filename_component\(_IMPORT_PREFIX "\$\{_IMPORT_PREFIX\}" PATH\)', targets))
    import_prefix = cmake_dir / "distvalsTargets.cmake"
    for _ in range(ups + 1):  # the first call strips the file name
        import_prefix = import_prefix.parent
    per_config = next(cmake_dir.glob("distvalsTargets-*.cmake")).read_text()
    m = re.search(r'IMPORTED_LOCATION_\w+ "\$\{_IMPORT_PREFIX\}/([^"]+)"', per_config)
    assert m, "no IMPORTED_LOCATION in the per-configuration targets file"
    incs = re.search(r'INTERFACE_INCLUDE_DIRECTORIES "([^"]+)"', targets)
    assert incs, "no INTERFACE_INCLUDE_DIRECTORIES for distvals::distvals"
    for d in incs.group(1).split(";"):
        d = Path(d.replace("${_IMPORT_PREFIX}", str(import_prefix)))
        assert (d / "distvals" / "distvals.hpp").is_file(), f"include dir {d} lacks distvals/distvals.hpp"
    return import_prefix / m.group(1)


def test_targets_file_points_at_the_package_files(prefix: Path, cmake_dir: Path) -> None:
    targets = (cmake_dir / "distvalsTargets.cmake").read_text()
    assert "add_library(distvals::distvals SHARED IMPORTED)" in targets
    loc = imported_location(cmake_dir)
    assert loc.resolve() == (prefix / "lib" / LIB_NAME).resolve(), f"targets file points at {loc}"


def test_cmake_prefix_entry_point(prefix: Path) -> None:
    from importlib import metadata

    eps = metadata.entry_points()
    group = eps.select(group="cmake.prefix") if hasattr(eps, "select") else eps.get("cmake.prefix", [])
    ours = [ep for ep in group if ep.name == "distvals"]
    assert len(ours) == 1, f"cmake.prefix entry points: {list(group)}"
    module = ours[0].load()
    # scikit-build-core adds the entry point's package directories to CMAKE_PREFIX_PATH.
    dirs = [Path(p).resolve() for p in getattr(module, "__path__", [])]
    assert prefix.resolve() in dirs
    assert any((d / "lib" / "cmake" / "distvals" / "distvalsConfig.cmake").is_file() for d in dirs)


@pytest.mark.skipif(not IS_LINUX, reason="reads /proc/self/maps")
def test_extension_loads_the_package_library(prefix: Path) -> None:
    code = (
        "import distvals._core\n"
        "print('\\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libdistvals' in l})))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert res.returncode == 0, res.stderr
    loaded = [Path(p) for p in res.stdout.split()]
    assert loaded, "distvals._core did not load libdistvals"
    assert [p.resolve() for p in loaded] == [(prefix / "lib" / LIB_NAME).resolve()], loaded


def dynamic_symbols(path: Path, *flags: str) -> List[str]:
    res = subprocess.run(["nm", "-D", "-C", *flags, str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    names = []
    for line in res.stdout.splitlines():
        # "ADDRESS TYPE NAME" for defined symbols, "TYPE NAME" for undefined ones.
        m = re.match(r"^\s*(?:[0-9a-fA-F]+\s+)?[A-Za-z?]\s+(.+)$", line)
        if m:
            names.append(m.group(1))
    return names


needs_nm = pytest.mark.skipif(not IS_LINUX or shutil.which("nm") is None, reason="needs nm on Linux")


@needs_nm
def test_library_exports_only_distvals_names(prefix: Path) -> None:
    syms = dynamic_symbols(prefix / "lib" / LIB_NAME, "--defined-only")
    allowed = ("distvals::", "typeinfo for distvals::", "typeinfo name for distvals::", "vtable for distvals::")
    leaked = [s for s in syms if not s.startswith(allowed)]
    assert not leaked, f"{len(leaked)} non-distvals exports, e.g. {leaked[:5]}"
    for name in ("distvals::group::run(", "distvals::make_schedule(", "typeinfo for distvals::mismatch_error"):
        assert any(s.startswith(name) for s in syms), f"{name} is not exported"


@needs_nm
def test_extension_uses_the_shared_engine(prefix: Path) -> None:
    core = next(prefix.glob("_core*"))
    undefined = dynamic_symbols(core, "--undefined-only")
    assert any(s.startswith("distvals::group::run(") for s in undefined), (
        "distvals._core does not take the engine from libdistvals"
    )
    defined = dynamic_symbols(core, "--defined-only")
    assert not any(s.startswith("distvals::group::") for s in defined), "distvals._core carries its own engine"


def cxx_compiler() -> str:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    return ""


def cmake_exe() -> str:
    here = Path(sys.executable).parent / "cmake"
    return str(here) if here.is_file() else (shutil.which("cmake") or "")


@pytest.mark.skipif(not cxx_compiler(), reason="no C++ compiler")
def test_umbrella_header_compiles_alone(prefix: Path, tmp_path: Path) -> None:
    src = tmp_path / "only_header.cpp"
    src.write_text(
        "#include <distvals/distvals.hpp>\n"
        'static_assert(DISTVALS_VERSION_MAJOR >= 0, "version macros");\n'
        "int main() { return distvals::dtype_size(distvals::dtype::float32) == 4 ? 0 : 1; }\n"
    )
    res = subprocess.run(
        [cxx_compiler(), "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", str(prefix / "include"), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not REPO_EXAMPLE.is_dir(), reason="examples/cpp is not beside the tests")
@pytest.mark.skipif(not cxx_compiler() or not cmake_exe(), reason="needs cmake and a C++ compiler")
def test_example_builds_against_the_installed_package(prefix: Path, tmp_path: Path) -> None:
    build = tmp_path / "build"
    cmake = cmake_exe()
    configure = [
        cmake,
        "-S",
        str(REPO_EXAMPLE),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DCMAKE_PREFIX_PATH={prefix}",
        f"-DCMAKE_CXX_COMPILER={cxx_compiler()}",
    ]
    ninja = Path(sys.executable).parent / "ninja"
    if ninja.is_file() or shutil.which("ninja"):
        configure += ["-G", "Ninja"]
        if ninja.is_file():
            configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_PREFIX_PATH", "distvals_DIR")}
    res = subprocess.run(configure, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    cache = (build / "CMakeCache.txt").read_text()
    m = re.search(r"^distvals_DIR:PATH=(.*)$", cache, re.M)
    assert m and Path(m.group(1)).resolve() == (prefix / "lib" / "cmake" / "distvals").resolve(), m
    res = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    exe = build / "distvals_example"
    res = subprocess.run([str(exe), "65536"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"the example failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    assert "all results right" in res.stdout
    # The table has a row per algorithm and style for each size (4 KiB and 64 KiB).
    rows = [line for line in res.stdout.splitlines() if re.match(r"\s+\d+\s+(ring|tree|direct|auto)\s", line)]
    assert len(rows) == 2 * 4 * 2, res.stdout
