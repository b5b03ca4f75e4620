"""Bucket splitting follows the links (issue 46): rumor.DistributedDataParallel closes a bucket at
a gap in backward only when the gap is longer than what one more bucket costs in round trips.

Two emulated hosts (rumor.testing.netns), one rank each, train the same chain of layers whose
backward pauses SLEEP_S between layers (a known gap, longer than the default 5 ms split gap):
- without delay, the rebuild after the first iteration splits at every pause (the rule of
  before, unchanged where round trips are short);
- with a 2 x DELAY_S round trip, one bucket costs more than the whole rest of backward, so
  neither the pauses nor the small first bucket pay for their own buckets: one bucket;
- with that round trip and a cap of one layer's weight (one bucket per weight and per bias,
  ready within the pauses), neighbouring buckets merge where one fewer ends the link's serial
  schedule sooner (engine.buckets.merge_for_link): their bytes are nothing beside the round
  trips, so one bucket again, while without delay the cap's buckets stay.
In both, the gradients equal a float64 single-process reference. Needs root and network
namespaces; skipped with the reason otherwise. Every run has a deadline; on it every rank is
killed and the test fails with each rank's output.
"""
from __future__ import annotations

import json
import os
import time

from harness import run_on_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
PORT = 29500             # inside host 0's fresh namespace nothing else listens
LAYERS = 4
WIDTH = 16
SLEEP_S = 0.015          # the pause in backward between layers: 3x the default split gap
DELAY_S = 0.15           # one way: a 300 ms round trip, far above the three pauses together
STEPS = 3
RUN_DEADLINE_S = 120

_BOOT = "import sys; sys.path.insert(0, {here!r}); import test_netns_buckets as t; t._rank_main()"


# ---- inside a rank -------------------------------------------------------------------------------

def _model():
    import torch

    class Pause(torch.autograd.Function):
        # Backward waits here, between two layers' gradients: a gap of at least SLEEP_S.
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            time.sleep(SLEEP_S)
            return g

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

        def forward(self, x):
            for layer in self.layers:
                x = Pause.apply(torch.tanh(layer(x)))
            return x

    return Chain()


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, WIDTH, generator=g)


def _rank_main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(RUN_DEADLINE_S - 5, exit=True)
    import torch

    import rumor

    rank = int(os.environ["RANK"])
    rumor.init(timeout=60)
    model = _model()
    # A first bucket of one layer (its weight is 1 KiB): the rest of backward follows it.
    cap_mb = float(os.environ.get("TEST_BUCKET_CAP_MB", "25"))
    ddp = rumor.DistributedDataParallel(model, first_bucket_mb=0.001, bucket_cap_mb=cap_mb)
    ref = _model().double()
    errors = []
    for step in range(STEPS):
        model.zero_grad()
        ddp(_batch(step, rank)).square().sum().backward()
        ref.zero_grad()
        for r in range(WORLD):
            (ref(_batch(step, r).double()).square().sum() / WORLD).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if not torch.allclose(p.grad.double(), q.grad, rtol=1e-5, atol=1e-6):
                errors.append(f"step {step} {name}: {(p.grad.double() - q.grad).abs().max().item():.3g}")
    out = {"rank": rank, "buckets": len(ddp.buckets), "latency_s": ddp._bucket_latency_s,
           "first_cap": ddp._first_cap_bytes, "errors": errors}
    print("RESULT " + json.dumps(out), flush=True)
    rumor.shutdown()
    os._exit(0)


# ---- the test (pytest process) -------------------------------------------------------------------

def _run(tmp_path, name: str, delay, cap_mb: float = 25):
    results, dump = run_on_hosts(tmp_path, name, _BOOT.format(here=HERE), WORLD, PORT, RUN_DEADLINE_S,
                                 env={"TEST_BUCKET_CAP_MB": str(cap_mb)}, delay=delay)
    for res in results:
        assert not res["errors"], f"{name}: gradients differ from the float64 reference: {res}\n{dump}"
    assert results[0]["buckets"] == results[1]["buckets"], f"{name}: ranks disagree on buckets: {results}"
    assert results[0]["latency_s"] == results[1]["latency_s"], f"{name}: ranks disagree on the estimate: {results}"
    return results[0]


def test_buckets_split_at_pauses_when_round_trips_are_short(tmp_path):
    res = _run(tmp_path, "lan", None)
    assert res["latency_s"] < 0.005, res  # a bridge between namespaces: well under the 5 ms gap
    # A new bucket at each of the LAYERS - 1 pauses, and the first (by its cap) before them.
    assert res["buckets"] >= LAYERS, res
    assert res["first_cap"] == int(0.001 * (1 << 20)), res  # as asked


def test_one_bucket_when_a_round_trip_outlasts_the_rest_of_backward(tmp_path):
    res = _run(tmp_path, "wan", f"{DELAY_S * 1e3:.0f}ms")
    # (hosts - 1) x the measured round trip: at least the 300 ms the forwarder holds packets.
    assert 2 * DELAY_S * 0.99 <= res["latency_s"] < 2 * DELAY_S * 3, res
    # One bucket: the link's schedule (merge_for_link) merged the small first bucket and every
    # pause, for each costs a round trip and the bytes cost next to nothing.
    assert res["buckets"] == 1, res


def test_capped_buckets_merge_when_round_trips_dwarf_their_bytes(tmp_path):
    cap_mb = WIDTH * WIDTH * 4 / (1 << 20)  # one weight per bucket
    lan = _run(tmp_path, "lan-capped", None, cap_mb)
    assert lan["buckets"] >= 2 * LAYERS - 1, lan  # the cap's buckets (a bias may share one)
    wan = _run(tmp_path, "wan-capped", f"{DELAY_S * 1e3:.0f}ms", cap_mb)
    assert wan["buckets"] == 1, wan
