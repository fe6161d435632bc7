"""Compiling the tests' Java sources (tests/java/KafkaCli.java, tests/chaos/ChaosWriter.java)
once per source content, so that concurrent pytest runs share the classes."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess


def compile_once(src: pathlib.Path, classpath: str, out: pathlib.Path, what: str) -> str:
    """javac ``src`` against ``classpath`` into ``out`` (a name holding the source hash) unless
    it is there already; returns the classpath with it. The directory is filled atomically
    (compile to a temporary directory, then rename), so a concurrent run never sees half a
    build; ``what`` names the build in the error."""
    if not (out / (src.stem + ".class")).exists():
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        proc = subprocess.run(["javac", "-nowarn", "-d", str(tmp), "-cp", classpath, str(src)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"javac {what} failed:\n{proc.stderr}")
        try:
            os.rename(tmp, out)
        except OSError:            # another run finished first: use its identical build
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out) + os.pathsep + classpath
