"""pdmesh.localmesh picks the mesh's fixed ports where its members cannot take them first.

A port chosen in the ephemeral range can be handed to a member's gRPC server (members bind
port 0) before the router binds it; the router's /health then answers HTTP/2 bytes and the
health probe fails with `BadStatusLine` (docs/incidents.md). Ports below the ephemeral
range cannot be handed out that way, and the health probe treats a non-HTTP answer as
"not healthy".
"""

import socket
import threading

from pdmesh import localmesh


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = localmesh._ephemeral_low()
    for _ in range(20):
        ports = localmesh.free_ports(3)
        assert len(set(ports)) == 3
        assert all(1024 <= p < low for p in ports), (ports, low)
        for p in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_free_port_skips_a_bound_port(monkeypatch):
    # The first candidates are taken: the next free one is what comes back.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        others = (1024 + (busy + i) % 60000 for i in range(1, 1000))
        candidates = iter([busy, busy, *others])

        class Picks:
            def randrange(self, a, b):
                return next(candidates)

        monkeypatch.setattr(localmesh.random, "Random", Picks)
        port = localmesh.free_port()
    assert port != busy


def test_health_probe_says_false_to_a_server_that_is_not_http():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer_in_http2_bytes():
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64\r\n")

        thread = threading.Thread(target=answer_in_http2_bytes)
        thread.start()
        assert localmesh._health(port) is False
        thread.join(5)
