"""The Makefile's choice of interpreter for the venv: the first usable one of PY_CANDIDATES
(the distribution's PGO/LTO build before whatever `python3` is on PATH), an explicit PY always
wins, and a machine with no usable candidate still gets `python3` (whose own error then says
what is missing)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture()
def makedir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory holding only the Makefile, so `.venv/bin/python` is always out of date."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    return tmp_path


def venv_command(makedir: pathlib.Path, *args: str, env: dict[str, str] | None = None) -> str:
    """The command `make` would run to create the venv (a dry run: nothing is created)."""
    # the suite itself may run under make (`make test`): its MAKEFLAGS/MAKELEVEL would turn this
    # into a sub-make that prints "Entering directory" and passes on the outer command line
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("PY", "PY_CANDIDATES") and not k.startswith(("MAKE", "MFLAGS"))}
    full_env.update(env or {})
    out = subprocess.run(["make", "--no-print-directory", "-n", ".venv/bin/python", *args],
                         cwd=makedir, env=full_env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.splitlines()[0]


def usable(interpreter: str) -> bool:
    """What the Makefile asks of an interpreter, asked directly."""
    probe = ("import ensurepip, os, sys, sysconfig; sys.exit(sys.version_info < (3, 11) or not "
             "os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))")
    try:
        return subprocess.run([interpreter, "-c", probe], capture_output=True,
                              timeout=60).returncode == 0
    except OSError:
        return False


def fake(path: pathlib.Path, exit_code: int) -> str:
    """An 'interpreter' that fails or passes every probe without being Python."""
    path.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    path.chmod(0o755)
    return str(path)


def test_default_is_the_first_usable_candidate(makedir: pathlib.Path) -> None:
    chosen = venv_command(makedir).split()[0]
    assert usable(chosen), chosen
    if usable("/usr/bin/python3"):
        assert chosen == "/usr/bin/python3"


def test_an_unusable_candidate_is_skipped(makedir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    old = fake(tmp_path / "old-python", 1)
    cmd = venv_command(makedir, f"PY_CANDIDATES={old} {sys.executable}")
    assert cmd == f"{sys.executable} -m venv .venv"


def test_no_usable_candidate_falls_back_to_python3(makedir: pathlib.Path,
                                                   tmp_path: pathlib.Path) -> None:
    old = fake(tmp_path / "old-python", 1)
    cmd = venv_command(makedir, f"PY_CANDIDATES={old} {tmp_path / 'missing'}")
    assert cmd == "python3 -m venv .venv"


def test_an_explicit_py_wins(makedir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    good = fake(tmp_path / "any-python", 0)
    assert venv_command(makedir, "PY=python3.12") == "python3.12 -m venv .venv"
    assert venv_command(makedir, env={"PY": "python3.13"}) == "python3.13 -m venv .venv"
    # PY given wins over a candidate that would pass
    assert venv_command(makedir, "PY=python3.12", f"PY_CANDIDATES={good}") \
        == "python3.12 -m venv .venv"
