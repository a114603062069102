"""Package layout and the native module; metadata lives in pyproject.toml.

The top-level directories map onto one import package: ``spyre_rt/`` is ``spyre_rt``,
``compiler/`` is ``spyre_rt.compiler`` and ``profiles/`` (data) is ``spyre_rt.profiles``.
The native module ``spyre_rt._native`` is built by cffi from ``native/``.
"""

from setuptools import find_packages, setup

ROOTS = {"spyre_rt": "spyre_rt", "spyre_rt.compiler": "compiler", "spyre_rt.profiles": "profiles"}

packages = []
for name, path in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(path)]

setup(
    packages=packages,
    package_dir=ROOTS,
    cffi_modules=["native/build.py:ffibuilder"],
)
