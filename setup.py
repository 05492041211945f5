"""Build: every root folder becomes a subpackage of ``kvroute``; every cython_ext/*.pyx an extension.

Folder -> import name mapping (see DESIGN.md §1): ``cache/`` -> ``kvroute.cache`` and so on. ``kvroute``
itself stays an implicit namespace package; the version comes from ``importlib.metadata``.
"""

from __future__ import annotations

from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent
LAYERS = ["cython_ext", "cache", "router", "engine_patches", "sim", "bench", "launch"]

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in LAYERS:
    top = f"kvroute.{folder}"
    packages.append(top)
    package_dir[top] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{top}.{sub}")
        package_dir[f"{top}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

extensions = [
    Extension(
        f"kvroute.cython_ext.{pyx.stem}",
        [str(pyx.relative_to(ROOT))],
        include_dirs=[numpy.get_include()],
        extra_compile_args=["-O3"],
    )
    for pyx in sorted((ROOT / "cython_ext").glob("*.pyx"))
]

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
    package_data={"kvroute.cython_ext": ["*.pyx", "*.pxd", "*.pxi"]},
)
