"""rumor._ports.free_port: a port for a listener that starts later, outside the range the
kernel hands to outgoing connections, and not one somebody holds."""
from __future__ import annotations

import socket

import pytest

from rumor import _ports


def test_the_port_is_outside_the_ephemeral_range_and_bindable():
    lo, hi = _ports._ephemeral_range()
    for _ in range(50):
        port = _ports.free_port()
        assert not lo <= port <= hi, (port, lo, hi)
        assert port >= 1024
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody held it


def test_a_held_port_is_never_returned(monkeypatch):
    lo, hi = _ports._ephemeral_range()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        # Every draw names the held port until the 64 draws are spent: the kernel's pick then.
        monkeypatch.setattr(_ports.random.SystemRandom, "randint", lambda self, a, b: taken)
        port = _ports.free_port()
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_an_address_of_another_machine_is_an_error():
    with pytest.raises(OSError):
        _ports.free_port("192.0.2.1")  # TEST-NET-1: never an address of this machine
