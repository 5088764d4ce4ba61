"""The stack's process group: a child that loses a port race is started again on another port."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from stack.processes import (
    CHOSEN_PORTS,
    Child,
    PortTakenError,
    ProcessGroup,
    ephemeral_ports,
    free_port,
    port_free,
    process_group,
)

SERVE = (
    "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen();"
    " print('listening', flush=True); time.sleep(60)"
)


class Listener(Child):
    """A child that binds one port and sleeps: ready once it says it listens (the port
    itself may answer for someone else: the test holds it)."""

    def __init__(self, directory: Path, port: int) -> None:
        self.port = port
        super().__init__(f"listener-{port}", [sys.executable, "-c", SERVE, str(port)], directory / f"{port}.log")

    def ready(self) -> bool:
        return "listening" in self.log_text()


def test_a_port_race_is_retried_on_a_fresh_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        with process_group() as group:
            child = group.start_ready(lambda: Listener(tmp_path, next(ports)))
            assert child.port != taken.getsockname()[1]
            assert group.children == [child]


def test_a_port_that_stays_taken_fails_with_the_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        group = ProcessGroup()
        try:
            with pytest.raises(PortTakenError, match="Address already in use"):
                group.start_ready(lambda: Listener(tmp_path, taken.getsockname()[1]), attempts=2)
            assert group.children == []
        finally:
            group.close()


def test_close_stops_every_child(tmp_path: Path) -> None:
    group = ProcessGroup()
    children = group.start_all_ready([lambda: Listener(tmp_path, free_port()) for _ in range(3)])
    codes = group.close(timeout=5)
    assert len(codes) == 3
    assert not any(child.alive() for child in children)


def test_a_chosen_port_is_free_and_below_the_ephemeral_range(tmp_path: Path) -> None:
    """No outgoing connection can be given a port between its choosing and a child binding it."""
    ephemeral = ephemeral_ports()
    chosen = {free_port() for _ in range(20)}
    if ephemeral.start - CHOSEN_PORTS.start >= 1000:
        assert all(port in CHOSEN_PORTS and port < ephemeral.start for port in chosen), chosen
    assert all(port_free(port) for port in chosen)


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_ports(tmp_path / "range") == range(40000, 50001)
    assert ephemeral_ports(tmp_path / "missing") == range(32768, 61000)


def test_ports_chosen_in_a_batch_are_all_different() -> None:
    """A batch of children is built before any binds: a port handed out once is not handed out
    again (500 picks of 5,000 ports would repeat one about 25 times by chance)."""
    chosen = [free_port() for _ in range(500)]
    assert len(set(chosen)) == len(chosen)
