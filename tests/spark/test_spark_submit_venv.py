"""README 'Run it': the venv's spark-submit works with PYSPARK_PYTHON pointing at the venv's
Python, even when the system python3 has no pyspark (the newcomer's SPARK_HOME error)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest


def test_venv_spark_submit_version_without_spark_home(tmp_path):
    pyspark = pytest.importorskip("pyspark")
    submit = pathlib.Path(sys.executable).parent / "spark-submit"
    if not submit.exists():
        submit = pathlib.Path(pyspark.__file__).parent / "bin" / "spark-submit"
    if shutil.which("java") is None:
        pytest.skip("no JDK (tests/setup_deps.sh installs openjdk-17-jdk-headless)")
    # PATH without the venv: `python3` there is the system one, as for a user who did not
    # activate the venv; SPARK_HOME unset
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if pathlib.Path(p).resolve() != submit.parent.resolve())
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    r = subprocess.run([str(submit), "--version"], capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and f"version {pyspark.__version__}" in out, out[-2000:]
