"""bench/ports.py: a port handed to one live process is not handed to another, even while
nothing listens on it (a broker killed for a restart)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from bench import ports
from conftest import REPO


def test_a_claimed_port_is_refused_to_every_live_process(tmp_path) -> None:
    reg = str(tmp_path / "ports")
    port = ports.free_port(reg)
    assert not ports.claim(port, reg), "this process claimed it twice"
    other = subprocess.run(
        [sys.executable, "-c", f"from bench import ports; print(ports.claim({port}, {reg!r}))"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == "False", other.stdout + other.stderr
    with socket.socket() as s:      # free on the host all along: only the registry holds it
        s.bind(("127.0.0.1", port))


def test_a_dead_process_s_ports_are_released(tmp_path) -> None:
    reg = str(tmp_path / "ports")
    dead = subprocess.run(
        [sys.executable, "-c", f"from bench import ports; p = ports.free_port({reg!r}); "
         f"print(p, ports.claim(p, {reg!r}))"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    port, again = dead.stdout.split()
    assert again == "False"
    assert ports.claim(int(port), reg), "the claim of an exited process was kept"
    assert open(reg).read().split() == [str(os.getpid()), port]


def test_free_port_skips_ports_claimed_elsewhere(tmp_path, monkeypatch) -> None:
    """The kernel's bind(0) may offer a claimed port: free_port asks again."""
    reg = str(tmp_path / "ports")
    offered = [41001, 41001, 41002]
    monkeypatch.setattr(ports, "_bound_port", lambda: offered.pop(0))
    assert ports.claim(41001, reg)
    assert ports.free_port(reg) == 41002
    assert offered == []


def test_listener_listens_on_a_claimed_port(tmp_path) -> None:
    reg = str(tmp_path / "ports")
    with ports.listener(4, registry=reg) as ls:
        port = ls.getsockname()[1]
        assert not ports.claim(port, reg)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = ls.accept()
            conn.close()


def test_listening_pid_owns_tells_whose_listener_answers() -> None:
    with ports.listener(4) as ls:
        port = ls.getsockname()[1]
        assert ports.listening_pid_owns(os.getpid(), port)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert not ports.listening_pid_owns(other.pid, port)
        finally:
            other.kill()
            other.wait()
    assert not ports.listening_pid_owns(os.getpid(), port), "closed, yet owned"
