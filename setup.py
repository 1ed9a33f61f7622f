"""Map the repository's layer folders into the one installed import name, `routing_replay`.

The folders are the architecture (README "Layout"): `protocol/` (floor), `capture/ producer/ broker/ consumer/`
(stages), `engines/`, `apps/`. Installed, each top-level package folder X becomes `routing_replay.X`; nothing
else is installed at the top level. Packages are found, not listed: any folder with an `__init__.py` at the
top of the repository (tests excepted) is a layer package, and its subpackages come along. One C extension,
optional: routing_replay.producer._gather.
"""

from setuptools import Extension, find_packages, setup

ROOT = "routing_replay"
found = find_packages(where=".", exclude=("tests", "tests.*", "build", "build.*"))
layers = sorted(p for p in found if "." not in p and p != ROOT)
setup(
    packages=[ROOT] + [f"{ROOT}.{p}" for p in found if p != ROOT and not p.startswith(ROOT + ".")],
    package_dir={ROOT: ROOT, **{f"{ROOT}.{layer}": layer for layer in layers}},
    # the producer's request-major copy in C (producer/_gather.c); optional: without a C compiler and Python's
    # headers the build goes on without it and producer/outpool.py copies with numpy (slower, the same bytes)
    ext_modules=[Extension(f"{ROOT}.producer._gather", ["producer/_gather.c"], optional=True)],
    exclude_package_data={"": ["*.c"]},             # the wheel carries the built module, not its source
)
