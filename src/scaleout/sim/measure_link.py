"""A network link's latency and bandwidth, measured over TCP between two processes.

`python -m scaleout.sim.measure_link serve PORT` answers every message with one byte;
`python -m scaleout.sim.measure_link probe HOST PORT` sends it messages and prints a JSON
line: the one-way latency (half the median round trip of a 1-byte message) and the
bandwidth (the slope of round-trip time against message size, `SIZES` bytes). Run the two
in two testnet hosts (network namespaces) (`benchmarks.testnet.measure_link`) and the
numbers are the emulated link's, as `scaleout calibrate --testnet RATE` records them
(`Calibration.link`).

A message is an 8-byte big-endian length, then that many bytes.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time

from scaleout.sim.measuring import fit_line

LATENCY_ROUNDS = 200
SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes per bulk message
BULK_ROUNDS = 3
CHUNK = 1 << 20


def _receive(conn: socket.socket, nbytes: int) -> None:
    left = nbytes
    while left:
        got = len(conn.recv(min(left, CHUNK)))
        if not got:
            raise ConnectionError("the peer closed the connection")
        left -= got


def serve(port: int) -> None:
    """Answer one client's messages, each with one byte, until it closes."""
    with socket.create_server(("0.0.0.0", port)) as server:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while header := conn.recv(8, socket.MSG_WAITALL):
                (nbytes,) = struct.unpack(">Q", header)
                _receive(conn, nbytes)
                conn.sendall(b"k")


def _round_trip(conn: socket.socket, payload: bytes) -> float:
    started = time.perf_counter()
    conn.sendall(struct.pack(">Q", len(payload)) + payload)
    _receive(conn, 1)
    return time.perf_counter() - started


def probe(host: str, port: int, connect_s: float = 30.0) -> dict[str, float]:
    """Latency and bandwidth to a `serve` at `host:port` (retries until it listens)."""
    deadline = time.monotonic() + connect_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        small = [_round_trip(conn, b"x") for _ in range(LATENCY_ROUNDS)]
        sizes, times = [], []
        for size in SIZES:
            payload = bytes(size)
            _round_trip(conn, payload)  # the window opens
            for _ in range(BULK_ROUNDS):
                sizes.append(size)
                times.append(_round_trip(conn, payload))
    _, seconds_per_byte = fit_line(sizes, times)
    return {"latency_s": statistics.median(small) / 2, "bytes_per_s": 1 / seconds_per_byte}


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(int(argv[1]))
    elif argv[:1] == ["probe"] and len(argv) == 3:
        print(json.dumps(probe(argv[1], int(argv[2]))))
    else:
        raise SystemExit("usage: measure_link serve PORT | probe HOST PORT")


if __name__ == "__main__":
    main(sys.argv[1:])
