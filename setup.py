"""Build of the optional C extensions storage._copycrc (a fused copy + CRC-32C for the produce
path) and protocol._produce (the envelope, checks and stamping of small Produce requests);
everything else is declared in pyproject.toml. A failed compile (no C compiler, no Python
headers) is not fatal: the install goes on and storage/copycrc.py falls back to memmove + the
crc32c package, with a one-line warning when the broker starts; without protocol._produce the
Python decoder and checks run (protocol/frames.py, broker/partition.py)."""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing when the extension cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - the extension is optional
            print(f"warning: storage._copycrc not built ({e}); the pure-Python path is used",
                  file=sys.stderr)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"warning: {ext.name} not built ({e}); the pure-Python path is used",
                  file=sys.stderr)


# Both extensions compute CRC-32C with crc32c.h (at the top of the tree: neither package owns
# it, so protocol and storage stay independent of each other)
CRC32C = dict(include_dirs=["."], depends=["crc32c.h"])

setup(
    ext_modules=[Extension("storage._copycrc", ["storage/_copycrc.c"],
                           extra_compile_args=["-O2"], optional=True, **CRC32C),
                 # the envelope of small Produce requests (protocol/frames.py parse_request)
                 Extension("protocol._produce", ["protocol/_produce.c"],
                           extra_compile_args=["-O2"], optional=True, **CRC32C)],
    cmdclass={"build_ext": OptionalBuildExt},
)
