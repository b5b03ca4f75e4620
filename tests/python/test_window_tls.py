"""Windows (rumor.win_*) over TLS (RUMOR_TLS_*, docs/security.md): three ranks on their own TCP
links (RUMOR_SHM=0, so every window byte takes the remote path: the window hub's TCP links).

put / accumulate / get with TLS on give exactly the bytes of the same run without TLS; a rank whose
certificate another CA issued fails every rank with an error that says TLS and names the peer (here
at rumor.init()'s barrier, the first connection between the ranks: the window link's own refusal
is tests/cpp/test_window_tls.cpp's, where ranks meet without a communicator). A relay that alters
one byte of a put or an accumulate on its way fails the op on both ends, naming the integrity
check, and changes no slot (as tests/cpp/test_window_tls.cpp checks on the hub alone).
"""
from __future__ import annotations

import hashlib

import pytest

import harness
from tls_pki import make_pki, tls_env

TCP = {"RUMOR_SHM": "0", "RUMOR_HOST_DIRECT": "0"}


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def rank_window_ops():
    """put, accumulate, get and update on a ring, with floats that use every mantissa bit; the
    digest of every result, and the number of frames the TCP links applied."""
    import torch

    import rumor
    from rumor.neighbor.window import registry

    torch.set_num_threads(1)
    rumor.init()
    try:
        n, r = rumor.size(), rumor.rank()
        nxt, prv = (r + 1) % n, (r - 1) % n
        g = torch.Generator().manual_seed(300 + r)
        out = {}
        x = torch.randn(100_003, generator=g, dtype=torch.float64)
        rumor.win_create(x, "x")
        rumor.barrier()
        rumor.win_put(x, "x", dst_weights={nxt: 0.3})
        rumor.barrier()
        out["put"] = _digest(rumor.win_update("x", self_weight=0.5, neighbor_weights={prv: 1.0}, clone=True))
        y = torch.randn(3 * 1024 * 1024 + 5, generator=g, dtype=torch.float32)  # past one seal (256 KiB)
        rumor.win_create(y, "y", zero_init=True)
        rumor.barrier()
        for j in range(n):
            if j != r:
                rumor.win_accumulate(y, "y", dst_weights={j: 0.25 + j})
        rumor.barrier()
        out["accumulate"] = _digest(rumor.win_update("y", self_weight=1.0,
                                                     neighbor_weights={j: 1.0 for j in range(n) if j != r},
                                                     clone=True))
        rumor.barrier()
        rumor.win_get("x", src_weights={prv: 2.0})
        out["get"] = _digest(rumor.win_update("x", self_weight=0.0, neighbor_weights={prv: 1.0}, clone=True))
        rumor.barrier()
        frames = registry().hub.frames_applied
        rumor.win_free()
        return out, frames
    finally:
        rumor.shutdown()


def test_window_ops_over_tls_are_bit_identical_to_plaintext(tmp_path):
    files = make_pki(tmp_path, 3)
    plain = harness.run(rank_window_ops, 3, timeout=120, env=TCP)
    tls = harness.run(rank_window_ops, 3, timeout=120, env=TCP, rank_env=[tls_env(files, r) for r in range(3)])
    for r in range(3):
        assert plain[r][1] > 0 and tls[r][1] > 0, f"rank {r}: no frame went over a window link"
        assert tls[r][0] == plain[r][0], f"rank {r}"
    assert len({d["put"] for d, _ in plain}) == 3  # each rank's result is its own


def rank_window_put_once():
    import torch

    import rumor

    rumor.init()
    try:
        x = torch.ones(1000)
        rumor.win_create(x, "x")
        rumor.win_put(x, "x")
        rumor.barrier()
        return True
    finally:
        rumor.shutdown()


def test_rank_with_certificate_of_another_ca_is_refused_naming_the_peer(tmp_path):
    files = make_pki(tmp_path, 3)
    # The store in clear (RUMOR_STORE_TLS=0): its tunnel would refuse rank 2 before any link does.
    res = harness.run(rank_window_put_once, 3, timeout=60, env=dict(TCP, RUMOR_TIMEOUT="10", RUMOR_STORE_TLS="0"),
                      raw=True, rank_env=[tls_env(files, r, foreign=r == 2) for r in range(3)])
    for r in res:
        assert not r.ok, f"rank {r.rank} succeeded"
        assert "tls" in r.error.lower(), f"rank {r.rank}: {r.error}"
    # Rank 2 dials ranks 0 and 1, which check its certificate and name it.
    refusals = [r for r in res if "certificate refused" in r.error and "rank 2 at 127.0.0.1:" in r.error]
    assert refusals, [r.error for r in res]


def rank_window_op_through_flip_relay(op):
    """Rank 1 reaches rank 0 through a relay in its own process (its address in the table of
    peers rewritten after the MAC check, as a man in the middle would redirect it) that alters
    one byte inside the first large payload it carries: the window op's. Returns (this rank's
    op error, whether the peer's slot still holds its initial value, whether the relay flipped)."""
    import os

    import torch

    import rumor
    from rumor import _rendezvous
    from tls_relay import Relay

    relays = []
    if os.environ["RANK"] == "1":
        exchange = _rendezvous.exchange

        def through_relay(*args, **kwargs):
            ctx, token, entries = exchange(*args, **kwargs)
            host, port = entries[0][1].rsplit(":", 1)
            # 400 KiB into what rank 1 sends on one connection: past any handshake, inside the
            # 1 MiB payload (the channels of the barriers never carry that much).
            relays.append(Relay(("127.0.0.1", 0), (host, int(port)), deadline_s=60, flip_at=400 * 1024))
            entries[0][1] = f"127.0.0.1:{relays[0].port}"
            return ctx, token, entries

        _rendezvous.exchange = through_relay
    rumor.init()
    try:
        r = rumor.rank()
        x = torch.arange(1 << 18, dtype=torch.float32) / 7.0 + (3 * r + 1)  # 1 MiB, each rank its own
        rumor.win_create(x, "x")
        rumor.barrier()
        call = rumor.win_put if op == "put" else rumor.win_accumulate
        err = ""
        # Rank 1's op is altered on the way; rank 0, which found the altered record, then fails its own.
        for turn in (1, 0):
            if r == turn:
                try:
                    call(x, "x", dst_weights={1 - r: 1.0})
                except Exception as e:  # noqa: BLE001 - the test reports whatever it is
                    err = f"{type(e).__name__}: {e}"
            rumor.barrier()
        slot = rumor.win_update("x", self_weight=0.0, neighbor_weights={1 - r: 1.0}, clone=True)
        return err, bool(torch.equal(slot, x)), bool(relays and relays[0].flipped.is_set())
    finally:
        rumor.shutdown()
        for relay in relays:
            relay.close()


@pytest.mark.parametrize("op", ["put", "accumulate"])
def test_a_byte_altered_on_a_window_link_fails_the_op_on_both_ends_and_is_never_applied(tmp_path, op):
    files = make_pki(tmp_path, 2)
    res = harness.run(rank_window_op_through_flip_relay, 2, timeout=90, env=dict(TCP, RUMOR_TIMEOUT="20"),
                      rank_env=[tls_env(files, r) for r in range(2)], args=(op,))
    (err0, untouched0, _), (err1, untouched1, flipped) = res
    assert flipped, "the relay altered nothing"
    # Rank 0 received the altered record: the integrity check failed there, naming rank 1.
    assert "integrity" in err0 and "rank 1 at 127.0.0.1:" in err0, err0
    # Rank 1 heard it from rank 0's alert.
    assert "window link to rank 0 failed" in err1 and "bad record mac" in err1.lower(), err1
    assert untouched0 and untouched1, "a slot changed: an altered (or half) frame was applied"
