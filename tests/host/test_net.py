"""`host.net`: the loopback port a single-node run's store listens on."""

import socket

from brigade.host.net import ephemeral_start, free_port


def test_a_free_port_is_drawn_below_the_range_outgoing_connections_take():
    port = free_port()
    assert 10000 <= port < ephemeral_start()
    with socket.socket() as s:  # and it is free: a store can listen on it
        s.bind(("127.0.0.1", port))

