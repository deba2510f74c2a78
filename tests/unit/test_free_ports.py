"""Rendezvous ports for a run's pools: distinct, unused, and outside the kernel's ephemeral range."""

import socket

from dyad.router import launcher
from dyad.router.launcher import free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(
        launcher._LOWEST_LISTEN_PORT <= p < launcher._ephemeral_start() for p in ports
    )
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_port_someone_listens_on_is_never_chosen(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # Squeeze the window to the busy port and its neighbours: only the neighbours are free.
        monkeypatch.setattr(launcher, "_LOWEST_LISTEN_PORT", taken - 15)
        monkeypatch.setattr(launcher, "_ephemeral_start", lambda: taken + 15)
        for _ in range(20):
            assert taken not in free_ports(2)


def test_no_room_below_the_ephemeral_range_falls_back_to_kernel_chosen_ports(
    monkeypatch,
):
    monkeypatch.setattr(
        launcher, "_ephemeral_start", lambda: launcher._LOWEST_LISTEN_PORT + 5
    )
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def test_no_ports_asked_none_given():
    assert free_ports(0) == []
