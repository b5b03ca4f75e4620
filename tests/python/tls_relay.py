"""A TCP relay for tests of TLS links: it forwards every connection it accepts to one target and
can record what passes (each connection's two directions in files of their own) and alter one
byte of it, once:

- flip_at=N: the byte at offset N of what a dialer sends (the first connection that sends that
  much), as tests/cpp/test_window_tls.cpp's relay does;
- flip_app_record=K: the first byte of the K-th TLS application-data record the server sends
  after the client's encrypted handshake flight (of the first connection that gets so far): with
  TLS 1.3 and no session tickets those are the server's answers, so the handshake succeeds and
  the damage lands on the data.

Also a script, for a relay inside an emulated host's namespace:
    python tls_relay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DEADLINE_S [--record DIR]
           [--flip-app-record K]
It prints "RELAY-READY <port>" once listening and runs until killed or its deadline.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import List, Optional, Tuple

APP_DATA = 23


class _Records:
    """Follows the TLS record boundaries of one direction's bytes."""

    def __init__(self):
        self.header = bytearray()
        self.left = 0  # body bytes of the current record still to come
        self.kind = 0

    def body_starts(self, data: bytearray) -> List[Tuple[int, int]]:
        """(offset in data, record type) of each record body that begins in data."""
        out, i = [], 0
        while i < len(data):
            if self.left:
                step = min(self.left, len(data) - i)
                self.left -= step
                i += step
                continue
            take = min(5 - len(self.header), len(data) - i)
            self.header += data[i:i + take]
            i += take
            if len(self.header) == 5:
                self.kind, self.left = self.header[0], int.from_bytes(self.header[3:5], "big")
                self.header.clear()
                if self.left and i < len(data):
                    out.append((i, self.kind))
                elif self.left:
                    out.append((len(data), self.kind))  # starts in the next chunk
        return out


class Relay:
    def __init__(self, listen: Tuple[str, int], target: Tuple[str, int], deadline_s: float = 120.0,
                 record: Optional[str] = None, flip_at: Optional[int] = None, flip_app_record: int = 0):
        self.target, self.record = target, record
        self.flip_at, self.flip_app_record = flip_at, flip_app_record
        self.deadline = time.monotonic() + deadline_s
        self.flipped = threading.Event()
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: List[socket.socket] = []
        self._threads: List[threading.Thread] = []
        self.listener = socket.create_server(listen, backlog=64)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self):
        self.listener.settimeout(0.2)
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            try:
                a, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=10)
                b.settimeout(None)  # a connection may idle for long: only the relay's deadline ends it
            except OSError:
                a.close()
                continue
            with self._lock:
                n = self.connections
                self.connections += 1
                self._socks += [a, b]
            state = {"client_flight": False, "pending_flip": None}
            for src, dst, way in ((a, b, "c2s"), (b, a, "s2c")):
                t = threading.Thread(target=self._pipe, args=(src, dst, n, way, state), daemon=True)
                self._threads.append(t)
                t.start()

    def _alter(self, data: bytearray, way: str, offset: int, records: _Records, state) -> None:
        if self.flipped.is_set():
            records.body_starts(data)
            return
        if self.flip_at is not None and way == "c2s" and offset <= self.flip_at < offset + len(data):
            data[self.flip_at - offset] ^= 0x5A
            self.flipped.set()
            return
        for i, kind in records.body_starts(data):
            if kind != APP_DATA or not self.flip_app_record:
                continue
            if way == "c2s":
                state["client_flight"] = True
            elif state["client_flight"]:
                state["answers"] = state.get("answers", 0) + 1
                if state["answers"] == self.flip_app_record and i < len(data):
                    data[i] ^= 0x5A
                    self.flipped.set()
                    return

    def _pipe(self, src, dst, n, way, state):
        """One direction. Its end (FIN) is passed on as a FIN, the other direction going on, as
        through one real connection: a TLS alert the other side sends as it closes still arrives.
        A destination that is gone makes the rest of this direction's bytes vanish, as a network's
        would, until the source ends."""
        records, offset, delivering = _Records(), 0, True
        out = open(os.path.join(self.record, f"conn{n}.{way}"), "wb") if self.record else None
        try:
            while time.monotonic() < self.deadline:
                try:
                    chunk = src.recv(1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                data = bytearray(chunk)
                self._alter(data, way, offset, records, state)
                offset += len(data)
                if out:
                    out.write(data)
                    out.flush()
                if delivering:
                    try:
                        dst.sendall(data)
                    except OSError:
                        delivering = False
        finally:
            if out:
                out.close()
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self.listener.close()
        self._acceptor.join(5)
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(5)
        for s in socks:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tls_records(data: bytes) -> List[Tuple[int, int]]:
    """(type, length) of every TLS record in data; raises ValueError where data is not a sequence
    of whole TLS records (a byte in clear)."""
    out, i = [], 0
    while i < len(data):
        if i + 5 > len(data):
            raise ValueError(f"a partial record header at {i}")
        kind, version, length = data[i], data[i + 1:i + 3], int.from_bytes(data[i + 3:i + 5], "big")
        if kind not in (20, 21, 22, 23) or version not in (b"\x03\x01", b"\x03\x03") or length > (1 << 14) + 256:
            raise ValueError(f"not a TLS record at {i}: {data[i:i + 5].hex()}")
        if i + 5 + length > len(data):
            raise ValueError(f"a record at {i} is cut short")
        out.append((kind, length))
        i += 5 + length
    return out


def main(argv: List[str]) -> None:
    host, port, thost, tport, deadline_s = argv[:5]
    record = argv[argv.index("--record") + 1] if "--record" in argv else None
    relay = Relay((host, int(port)), (thost, int(tport)), float(deadline_s), record=record,
                  flip_app_record=int(argv[argv.index("--flip-app-record") + 1]) if "--flip-app-record" in argv else 0)
    print(f"RELAY-READY {relay.port}", flush=True)
    try:
        reported = False
        while time.monotonic() < relay.deadline:
            if not reported and relay.flipped.wait(0.2):
                print("RELAY-FLIPPED", flush=True)
                reported = True
            elif reported:
                time.sleep(0.2)
    finally:
        relay.close()


if __name__ == "__main__":
    main(sys.argv[1:])
