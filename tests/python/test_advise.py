"""rumor.advise: the measurements, the table, the prediction model, the command line.

* The link-bound model (rumor.advisor.predict) against step times worked out by hand from
  synthetic measurements (exact arithmetic on floats, compared with a relative 1e-12).
* The API on 2 ranks of one host and on 2 hosts x 2 ranks (RUMOR_HOST_ID, so the network path
  is TCP over loopback): every rank gets the same table, the measured quantities are what the
  model really holds (gradient bytes exactly) and positive, rows are ordered by predicted step
  (ties within 1% go to the more exact algorithm),
  no prediction is below the measured compute (the ranks' mean step for the periodic and
  asynchronous rows), 1-bit Adam appears only for Adam, and the model
  and optimizer come back bit for bit.
* ``python -m rumor.advisor --nproc-per-node 2 script.py`` with a script defining rumor_advise().
No timing is asserted: the figures are whatever this machine measured.
The accuracy check against measured step times needs emulated hosts: benchmarks/advise.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

import harness

REL = 1e-12


def _codecs(w=1.0):
    names = ("ByteGrad", "QSGD", "fp16", "bf16", "1-bit")
    wire = {"ByteGrad": w, "QSGD": w, "fp16": 2.0, "bf16": 2.0, "1-bit": 0.125}
    return {k: dict(encode_s_per_element=0.0, decode_s_per_element=0.0, wire_bytes_per_element=wire[k])
            for k in names}


def _measured(**kw):
    m = dict(ranks=4, hosts=4, local_size=1, forward_s=0.01, backward_s=0.02, optimizer_s=0.005,
             grad_bytes=8_000_000, grad_bytes_per_element=4.0, codecs=_codecs(),
             buckets=[(0.005, 1_000_000), (0.02, 7_000_000)])
    m.update(kw)
    return m


def _rows(m, inter, intra=None, adam=False):
    from rumor.advisor.model import predict

    return {r["algorithm"]: r for r in predict(m, intra, inter, adam=adam)}


def test_prediction_model_by_hand():
    from rumor.advisor.model import Link, predict, predict_torch

    B, a = 125e6, 1e-4  # 1 Gbit, 100 us
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    m = _measured()
    ring = lambda nbytes, n=4: 2 * (n - 1) / n * nbytes / B + 2 * (n - 1) * a  # noqa: E731
    rows = {r["algorithm"]: r for r in predict(m, None, inter, adam=True)}
    # GradientAllReduce: bucket 1 from 5 ms, bucket 2 after it (or when ready at 20 ms)
    t1 = 0.005 + ring(1e6)
    t2 = max(t1, 0.02) + ring(7e6)
    expect = 0.01 + max(0.02, t2) + 0.005
    assert rows["GradientAllReduce"]["predicted_step_s"] == pytest.approx(expect, rel=REL)
    assert rows["GradientAllReduce"]["exposed_comm_s"] == pytest.approx(t2 - 0.02, rel=REL)
    # ByteGrad: a quarter of the bytes on the wire (codec time zero here)
    t1 = 0.005 + ring(0.25e6)
    t2 = max(t1, 0.02) + ring(1.75e6)
    assert rows["ByteGrad"]["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005, rel=REL)
    # 1-bit Adam: 1/32 of the bytes
    t1 = 0.005 + ring(1e6 / 32)
    t2 = max(t1, 0.02) + ring(7e6 / 32)
    assert rows["1-bit Adam"]["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005, rel=REL)
    # Decentralized shift_one: one message of all the weights to one peer, behind forward + backward
    mix = 8e6 / B + a
    assert rows["Decentralized shift_one"]["predicted_step_s"] == pytest.approx(max(0.03, mix) + 0.005, rel=REL)
    assert rows["Decentralized all"]["predicted_step_s"] == pytest.approx(max(0.03, ring(8e6)) + 0.005, rel=REL)
    # LowPrecisionDecentralized without buffers: two 1-byte-per-element messages (one per ring
    # neighbour) behind forward + backward; the prepare costs nothing with free codecs
    xchg = 2 * 2e6 / B + a
    assert rows["LowPrecisionDecentralized"]["predicted_step_s"] == pytest.approx(max(0.03, xchg) + 0.005, rel=REL)
    # ... with buffers to broadcast, the next forward waits for the exchange (and the broadcast)
    bc = 2 * (1000 / B + a)  # 2 hops of a tree over 4 hosts
    rows_b = _rows(_measured(buffer_bytes=1000, buffer_broadcast_s=bc), inter)
    assert rows_b["LowPrecisionDecentralized"]["predicted_step_s"] == pytest.approx(xchg + bc + 0.035, rel=REL)
    # Periodic: LocalSGD pays an allreduce of the weights every 8 steps, DiLoCo every 32 (its
    # weight passes free here); the local step is compute only.
    assert rows["LocalSGD every 8"]["predicted_step_s"] == pytest.approx(0.035 + ring(8e6) / 8, rel=REL)
    assert rows["LocalSGD every 8"]["period"] == 8 and rows["DiLoCo H=32"]["period"] == 32
    assert rows["DiLoCo H=32"]["predicted_step_s"] == pytest.approx(0.035 + ring(8e6) / 32, rel=REL)
    # Streaming DiLoCo: a quarter of the weights in int8 per fragment, hidden behind tau = 4 steps
    assert rows["StreamingDiLoCo H=32"]["predicted_step_s"] == pytest.approx(
        0.035 + 4 * max(0.0, ring(0.5e6) - 4 * 0.035) / 32, rel=REL)
    # AsyncModelAverage: never waits; with free weight arithmetic it costs nothing
    assert rows["AsyncModelAverage"]["predicted_step_s"] == pytest.approx(0.035, rel=REL)
    # torch DDP: the flat fp32 ring over its own buckets (none here: GradientAllReduce's)
    assert predict_torch(m, None, inter)["predicted_step_s"] == pytest.approx(expect, rel=REL)
    # without Adam there is no 1-bit Adam row; with several ranks per host a hierarchical row
    rows2 = {r["algorithm"] for r in predict(_measured(ranks=8, local_size=2), Link(2, 5e9, 1e-6), inter, adam=False)}
    assert "1-bit Adam" not in rows2 and "GradientAllReduce hierarchical" in rows2


def test_hierarchical_legs_inside_a_host_by_hand():
    """With several ranks on each of several hosts, the hierarchical allreduce reduces to the
    host's leader and broadcasts back (the measured ends, not the host's ring); hierarchical
    mixing is the host's ring, the leaders' exchange and the leader's broadcast."""
    from rumor.advisor.model import Link

    B, a = 125e6, 1e-4
    inter = Link(n=2, bandwidth_Bps=B, latency_s=a)
    intra = Link(n=2, bandwidth_Bps=4e9, latency_s=1e-5)
    ends, bcast = Link(2, 1e9, 2e-5), Link(2, 3e9, 1e-5)
    m = _measured(ranks=4, hosts=2, local_size=2, intra_ends=dict(ranks=2, bandwidth_Bps=1e9, latency_s=2e-5),
                  intra_broadcast=dict(ranks=2, bandwidth_Bps=3e9, latency_s=1e-5))
    rows = _rows(m, inter, intra=intra)
    ring = lambda nbytes: nbytes / B + 2 * a  # noqa: E731  (two hosts)
    t1 = 0.005 + ends.hop(1e6) + ring(1e6)
    t2 = max(t1, 0.02) + ends.hop(7e6) + ring(7e6)
    for name in ("GradientAllReduce", "GradientAllReduce hierarchical"):
        assert rows[name]["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005, rel=REL), name
    # ByteGrad: full precision to the leader and back, a quarter of the bytes between hosts
    t1 = 0.005 + ends.hop(1e6) + ring(0.25e6)
    t2 = max(t1, 0.02) + ends.hop(7e6) + ring(1.75e6)
    assert rows["ByteGrad"]["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005, rel=REL)
    # "all" averages the weights with the hierarchical allreduce; the other selections run the
    # host's ring, the leaders' exchange and the leader's broadcast
    mix = ends.hop(8e6) + ring(8e6)
    assert rows["Decentralized all"]["predicted_step_s"] == pytest.approx(max(0.03, mix) + 0.005, rel=REL)
    mix = intra.ring(8e6) + (8e6 / B + a) + bcast.hop(8e6)
    assert rows["Decentralized shift_one"]["predicted_step_s"] == pytest.approx(max(0.03, mix) + 0.005, rel=REL)
    # Beside compute the legs inside a host run at their own measured rate: a mix of l seconds
    # there and n on the network progresses at (l + n) / (l / r_local + n / r_network) until
    # compute ends
    slow = _rows(dict(m, local_rate_beside_compute=0.25, comm_rate_beside_compute=0.5, backward_s=0.5), inter,
                 intra=intra)
    legs, net = ends.hop(8e6), ring(8e6)
    rate = (legs + net) / (legs / 0.25 + net / 0.5)
    assert (legs + net) / rate < 0.51  # all of it beside compute
    assert slow["Decentralized all"]["predicted_step_s"] == pytest.approx(0.51 + 0.005, rel=REL)
    fast = _rows(dict(m, local_rate_beside_compute=0.25, comm_rate_beside_compute=0.5, backward_s=0.1), inter,
                 intra=intra)
    beside = 0.11 * rate  # of the mix's time alone, done by the end of compute
    assert fast["Decentralized all"]["predicted_step_s"] == pytest.approx(0.11 + legs + net - beside + 0.005,
                                                                            rel=REL)
    sync = ends.hop(8e6) + ring(8e6)
    assert rows["LocalSGD every 8"]["predicted_step_s"] == pytest.approx(0.035 + sync / 8, rel=REL)
    # a table measured before the ends were: the host's ring stands in for them, no broadcast
    old = _rows(_measured(ranks=4, hosts=2, local_size=2), inter, intra=intra)
    t1 = 0.005 + intra.ring(1e6) + ring(1e6)
    t2 = max(t1, 0.02) + intra.ring(7e6) + ring(7e6)
    assert old["GradientAllReduce"]["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005, rel=REL)
    mix = intra.ring(8e6) + ring(8e6)
    assert old["Decentralized all"]["predicted_step_s"] == pytest.approx(max(0.03, mix) + 0.005, rel=REL)
    # LowPrecisionDecentralized: the mix and the codec run on the host leaders only, the other
    # ranks waiting for the broadcast; with a CPU share of 0.5 per rank (4 ranks on 2 cores) a
    # leader gets a whole core: the per-element work takes half its measured time
    codecs = _codecs()
    codecs["ByteGrad"].update(encode_s_per_element=1e-9, decode_s_per_element=2e-9)
    lp = [_rows(dict(m, codecs=codecs, elementwise_s_per_element=1e-9, compute_cpu_share=share), inter,
                intra=intra)["LowPrecisionDecentralized"]["predicted_step_s"] for share in (1.0, 0.5)]
    assert lp[0] - lp[1] == pytest.approx(2e6 * (2e-9 + 1e-9 + 2e-9) / 2, rel=1e-9)


def test_one_host_weight_mix_and_loopback_by_hand():
    """Every rank on one host: Decentralized mixes the host's exact average (copy + allreduce,
    then a broadcast for the one-peer selections) at its measured rate beside compute, and
    compute loses the mix's measured stretch per second of it done meanwhile; torch DDP's gloo
    ring runs over loopback TCP at its own rate beside compute, its threads summing (n-1)/n of
    each bucket, compute losing the loopback's stretch. A table without those figures keeps
    the shared-memory ring."""
    from rumor.advisor.model import Link, predict_torch

    intra = Link(n=4, bandwidth_Bps=4e9, latency_s=1e-5)
    bcast = Link(2, 2e9, 1e-5)
    lo = Link(2, 1e9, 1e-4)
    one = dict(ranks=4, hosts=1, local_size=4, intra_broadcast=dict(ranks=4, bandwidth_Bps=2e9, latency_s=1e-5),
               mix_s_per_byte=2e-9, mix_rate_beside_compute=0.2, mix_stretch=1.0,
               loopback=dict(ranks=2, bandwidth_Bps=1e9, latency_s=1e-4), loopback_rate_beside_compute=0.5,
               loopback_stretch=1.5, elementwise_s_per_element=1e-9)
    m = _measured(**one)
    rows = _rows(m, None, intra=intra)
    mix = 2e-9 * 8e6
    for name, mix_s in (("Decentralized all", mix), ("Decentralized shift_one", mix + bcast.hop(8e6))):
        cpu = min(mix_s, 0.03 * 0.2)  # stretch 1 x the mix's work done beside 30 ms of compute
        beside = (0.03 + cpu) * 0.2
        assert beside < mix_s
        assert rows[name]["predicted_step_s"] == pytest.approx(0.03 + cpu + mix_s - beside + 0.005, rel=REL), name
    # long compute: the mix hides at a fifth of its speed, compute still pays the whole mix once
    long = _rows(dict(m, backward_s=0.5), None, intra=intra)
    assert long["Decentralized all"]["predicted_step_s"] == pytest.approx(0.51 + mix + 0.005, rel=REL)
    # torch DDP: buckets of 1 and 7 MB ready at 5 and 20 ms; the ring sends 1.5x the bucket
    def comm(nbytes):
        return 1.5 * nbytes / lo.bandwidth_Bps + 6 * lo.latency_s, 0.75 * nbytes / 4 * 1e-9
    cpu = 1.5 * min(1.5 * 8e6 / 1e9, 0.02 * 0.5)
    busy = 0.02 + cpu
    link1, work1 = comm(1e6)
    t1 = 0.005 + work1 + link1 / 0.5  # all of it beside compute, at half speed
    assert t1 < busy
    lost = cpu / 8  # the first bucket's share of the traffic's cost, taken before the second is ready
    link2, work2 = comm(7e6)
    start = max(t1, 0.02 + lost) + work2
    assert start < busy and (busy - start) * 0.5 < link2  # it outlasts backward
    t2 = busy + link2 - (busy - start) * 0.5
    assert predict_torch(m, intra, None)["predicted_step_s"] == pytest.approx(0.01 + t2 + 0.005, rel=REL)
    # tables measured before: the shared-memory ring for both
    old = _measured(ranks=4, hosts=1, local_size=4)
    rows = _rows(old, None, intra=intra)
    assert rows["Decentralized all"]["predicted_step_s"] == pytest.approx(max(0.03, intra.ring(8e6)) + 0.005,
                                                                          rel=REL)
    t1 = 0.005 + intra.ring(1e6)
    t2 = max(t1, 0.02) + intra.ring(7e6)
    assert predict_torch(old, intra, None)["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005,
                                                                                rel=REL)


def test_network_slowed_beside_compute_and_the_pairwise_link():
    """Communication that runs while compute does progresses at the measured rate beside
    compute until compute ends, then at full speed; shift_one's and LowPrecisionDecentralized's
    exchanges with peers use the pairwise link (both directions at once), not the ring's."""
    from rumor.advisor.model import Link

    B, a = 125e6, 1e-4
    P, pa = 100e6, 2e-5  # the pairwise swap: slower than the ring's rate
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    ring = lambda nbytes, n=4: 2 * (n - 1) / n * nbytes / B + 2 * (n - 1) * a  # noqa: E731
    pair = dict(ranks=2, bandwidth_Bps=P, latency_s=pa)
    rows = _rows(_measured(comm_rate_beside_compute=0.5, pair=pair), inter)
    # bucket 1 from 5 ms: at half speed until backward ends at 20 ms, the rest at full speed
    t1 = 0.02 + ring(1e6) - 0.5 * 0.015
    t2 = t1 + ring(7e6)
    assert rows["GradientAllReduce"]["predicted_step_s"] == pytest.approx(0.01 + t2 + 0.005, rel=REL)
    # the mix starts with forward: 30 ms at half speed, then the rest
    mix = 8e6 / P + pa
    assert rows["Decentralized shift_one"]["predicted_step_s"] == pytest.approx(0.03 + mix - 0.015 + 0.005, rel=REL)
    xchg = 2 * 2e6 / P + pa
    assert rows["LowPrecisionDecentralized"]["predicted_step_s"] == pytest.approx(
        0.03 + xchg - 0.015 + 0.005, rel=REL)
    # a compressed bucket: its codec work first (not slowed: measured with every rank busy),
    # then its bytes on the link, at half speed while backward runs
    codecs = _codecs()
    codecs["ByteGrad"].update(encode_s_per_element=1e-9, decode_s_per_element=2e-9)
    bg = _rows(_measured(comm_rate_beside_compute=0.5, codecs=codecs), inter)["ByteGrad"]
    work = lambda el: el * (1e-9 * 1.25 + 2e-9 * 1.75)  # noqa: E731  (4 hosts: encode 1 + 1/4, decode 2 - 1/4)
    s1 = 0.005 + work(0.25e6)
    t1 = s1 + ring(0.25e6) / 0.5 if s1 + ring(0.25e6) / 0.5 <= 0.02 else 0.02 + ring(0.25e6) - 0.5 * (0.02 - s1)
    s2 = max(t1, 0.02) + work(1.75e6)
    t2 = s2 + ring(1.75e6)
    assert bg["predicted_step_s"] == pytest.approx(0.01 + t2 + 0.005, rel=REL)
    # a short exchange ends beside compute, at half speed
    short = _rows(_measured(comm_rate_beside_compute=0.5, pair=dict(ranks=2, bandwidth_Bps=1e12, latency_s=1e-3),
                            net_cost_s_per_byte=0.0), inter)
    assert short["Decentralized shift_one"]["predicted_step_s"] == pytest.approx(0.035, rel=REL)
    # AsyncModelAverage: a round is the weights' allreduce beside compute (here longer than
    # the interval), and costs the step nothing with free weight arithmetic
    assert rows["AsyncModelAverage"]["predicted_step_s"] == pytest.approx(0.035, rel=REL)
    # one host: no network, the rate is not applied
    one = _rows(_measured(ranks=2, hosts=1, local_size=2, comm_rate_beside_compute=0.5),
                None, intra=Link(n=2, bandwidth_Bps=B, latency_s=a))
    ref = _rows(_measured(ranks=2, hosts=1, local_size=2), None, intra=Link(n=2, bandwidth_Bps=B, latency_s=a))
    assert one["GradientAllReduce"]["predicted_step_s"] == ref["GradientAllReduce"]["predicted_step_s"]


def test_network_cpu_stretches_the_compute_it_overlaps():
    """The measured CPU cost of a byte sent between hosts is added to the compute that traffic
    runs beside; a link fast enough to hide the communication leaves that cost alone."""
    from rumor.advisor.model import AMA_INTERVAL_MS, Link, predict_torch

    B, a, c = 125e9, 1e-6, 1e-9  # a link that hides everything; 1 ms of compute per MB sent
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    m = _measured(net_cost_s_per_byte=c)
    rows = _rows(m, inter)
    sent = 1.5 * 8e6  # each rank's share of a 4-host ring over all gradients
    assert rows["GradientAllReduce"]["predicted_step_s"] == pytest.approx(0.01 + 0.02 + c * sent + 0.005, rel=REL)
    assert rows["GradientAllReduce"]["exposed_comm_s"] == pytest.approx(c * sent, rel=REL)
    assert rows["ByteGrad"]["predicted_step_s"] == pytest.approx(0.035 + c * sent / 4, rel=REL)
    assert rows["Decentralized shift_one"]["predicted_step_s"] == pytest.approx(0.035 + c * 8e6, rel=REL)
    assert rows["Decentralized all"]["predicted_step_s"] == pytest.approx(0.035 + c * sent, rel=REL)
    # a blocking average is wall time already: LocalSGD's round is not charged twice
    ring = 1.5 * 8e6 / B + 6 * a
    assert rows["LocalSGD every 8"]["predicted_step_s"] == pytest.approx(0.035 + ring / 8, rel=REL)
    # AsyncModelAverage: a round every 500 ms, each sending `sent` bytes beside compute
    assert rows["AsyncModelAverage"]["predicted_step_s"] == pytest.approx(
        0.035 * (1 + c * sent / (AMA_INTERVAL_MS / 1e3)), rel=REL)
    assert predict_torch(m, None, inter)["predicted_step_s"] == pytest.approx(0.035 + c * sent, rel=REL)
    # inside one host nothing goes over the network
    one = _rows(_measured(hosts=1, local_size=4, net_cost_s_per_byte=c), None, intra=Link(4, B, a))
    free = _rows(_measured(hosts=1, local_size=4), None, intra=Link(4, B, a))
    assert one["GradientAllReduce"]["predicted_step_s"] > 0.035
    for name in free:
        assert one[name]["predicted_step_s"] == free[name]["predicted_step_s"], name


def test_powersgd_model_by_hand():
    from rumor.advisor.model import Link, _powersgd_bucket

    B, a = 125e6, 1e-4
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    ring = lambda nbytes: 1.5 * nbytes / B + 6 * a  # noqa: E731
    # a 1000 x 1000 matrix (rank 4: P 4000, Q 4000 elements), a bias of 1000 (uncompressed) and
    # a 3 x 3 matrix (too small to compress: (3 + 3) 3 * 2 >= 9)
    shapes = [[1000, 1000], [1000], [3, 3]]
    assert _powersgd_bucket(shapes, [0, 1, 2], 4) == (4000 + 1000 + 9, 4000, 1_000_000)
    # the kernels' probe includes error feedback; the uncompressed values cost one pass (their
    # copy into the send buffer), the compressed matrices nothing more than the kernels
    ew = 2e-10
    m = _measured(grad_bytes=4 * 1_001_009, shapes=shapes, bucket_params=[[1, 2], [0]],
                  buckets=[(0.005, 4 * 1009), (0.02, 4_000_000)], powersgd_rank=4, powersgd_s_per_element=1e-9,
                  elementwise_s_per_element=ew)
    t1 = 0.005 + 1009 * ew + ring(4 * 1009)
    t2 = max(t1, 0.02) + 4000 * ew + 1_000_000 * 1e-9 + ring(4 * 4000) + ring(4 * 4000)
    assert _rows(m, inter)["PowerSGD rank 4"]["predicted_step_s"] == pytest.approx(0.01 + max(0.02, t2) + 0.005,
                                                                                   rel=REL)


def test_powersgd_probe_shape_follows_the_largest_matrix():
    """The kernel probe runs on the job's largest matrix (first dimension by the rest, as PowerSGD
    views it), rows cut to the element cap; without a compressible matrix, the fixed probe."""
    from rumor.advisor.measure import powersgd_probe_shape

    mlp = [[4096, 1024], [4096], [4096, 4096], [4096], [1024, 4096], [1024]]
    assert powersgd_probe_shape(mlp) == (2048, 4096)
    assert powersgd_probe_shape(mlp, cap=1 << 30) == (4096, 4096)
    assert powersgd_probe_shape([[64, 3, 3, 3], [64], [10, 64]]) == (64, 27)
    assert powersgd_probe_shape([[1, 300], [300]]) == (512, 2048)
    assert powersgd_probe_shape([[8, 1 << 24]]) == (1, 1 << 24)


def _link(B):
    """The same job on a link of bandwidth B (latency 50 us), 4 hosts."""
    from rumor.advisor.model import Link

    return Link(n=4, bandwidth_Bps=B, latency_s=5e-5)


def _realistic(**kw):
    """A 24M-parameter model (mlp25m-like) whose gradients come over 80 ms of backward, with codec and weight
    arithmetic costs of this order on a CPU."""
    from rumor.advisor.model import bucket_plan, bucket_times, torch_bucket_plan

    shapes = [[4096, 1024], [4096], [4096, 4096], [4096], [1024, 4096], [1024]][::-1]
    nbytes = [4 * (s[0] * (s[1] if len(s) > 1 else 1)) for s in shapes]
    ready = [0.002, 0.003, 0.040, 0.041, 0.079, 0.080]
    codecs = {k: dict(encode_s_per_element=3e-10, decode_s_per_element=2e-10, wire_bytes_per_element=w)
              for k, w in (("ByteGrad", 1.0), ("QSGD", 1.0), ("fp16", 2.0), ("bf16", 2.0), ("1-bit", 0.13))}
    plan = bucket_plan(ready, nbytes)
    m = dict(ranks=4, hosts=4, local_size=1, forward_s=0.04, backward_s=0.08, optimizer_s=0.01,
             grad_bytes=sum(nbytes), grad_bytes_per_element=4.0, codecs=codecs, shapes=shapes,
             bucket_params=plan, buckets=bucket_times(plan, ready, nbytes),
             torch_buckets=bucket_times(torch_bucket_plan(ready, nbytes), ready, nbytes),
             elementwise_s_per_element=5e-10, powersgd_rank=4, powersgd_s_per_element=3e-9,
             buffer_bytes=0, buffer_broadcast_s=0.0)
    m.update(kw)
    return m


RATES = [10e6 / 8, 100e6 / 8, 1e9 / 8, 10e9 / 8, 100e9 / 8]


def test_unsynchronized_steps_take_the_ranks_mean_compute():
    """Periodic and asynchronous algorithms synchronize no step: their local step is the ranks'
    mean compute step (free_step_s), not the slowest rank's phases; algorithms that synchronize
    every step keep the latter."""
    from rumor.advisor.model import Link

    B, a = 125e6, 1e-4
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    ring = lambda nbytes: 1.5 * nbytes / B + 6 * a  # noqa: E731
    base = _rows(_measured(), inter)
    rows = _rows(_measured(free_step_s=0.025), inter)
    assert rows["LocalSGD every 8"]["predicted_step_s"] == pytest.approx(0.025 + ring(8e6) / 8, rel=REL)
    assert rows["DiLoCo H=32"]["predicted_step_s"] == pytest.approx(0.025 + ring(8e6) / 32, rel=REL)
    assert rows["AsyncModelAverage"]["predicted_step_s"] == pytest.approx(0.025, rel=REL)
    for name in ("GradientAllReduce", "ByteGrad", "Decentralized all", "LowPrecisionDecentralized"):
        assert rows[name]["predicted_step_s"] == base[name]["predicted_step_s"], name


def test_async_model_average_round_by_hand():
    """AsyncModelAverage's rounds: across hosts the thread's weight passes (two copies at two
    thirds of a pass, the reduction's (k-1)/k, the delta) follow its allreduce, so they lengthen
    the round; a round costs compute those passes, the training thread's one adding the result
    and the network's CPU; the step pays its share of a round. On one host the rounds are
    spaced so that the thread is busy a tenth of the time."""
    from rumor.advisor.model import AMA_INTERVAL_MS, Link

    B, a, ew, c = 12.5e6, 1e-4, 1e-9, 1e-10  # 100 Mbit: a round outlasts the interval
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    m = _measured(elementwise_s_per_element=ew, net_cost_s_per_byte=c, comm_rate_beside_compute=0.5)
    el = 2e6
    local = 0.035
    thread = (4 / 3 + 3 / 4 + 1) * el * ew
    ring = lambda nbytes: 1.5 * nbytes / B + 6 * a  # noqa: E731
    round_s = ring(8e6) / 0.5 + ring(32) + thread
    assert round_s > AMA_INTERVAL_MS / 1e3
    cost = thread + el * ew + c * 1.5 * 8e6
    row = _rows(m, inter)["AsyncModelAverage"]
    assert row["round_s"] == pytest.approx(round_s, rel=REL)
    assert row["predicted_step_s"] == pytest.approx(local + local / round_s * cost, rel=REL)
    # one host: the arena's exchange is two thirds of a pass, rounds at most 10% busy
    intra = Link(n=4, bandwidth_Bps=5e9, latency_s=1e-6)
    big = 2e9  # large enough that the busy bound, not the interval, spaces the rounds
    one = _rows(_measured(hosts=1, local_size=4, grad_bytes=big, elementwise_s_per_element=ew), None, intra=intra)
    thread = 2 / 3 * big / 4 * ew
    round_s = intra.ring(32) + thread / 0.1
    assert one["AsyncModelAverage"]["round_s"] == pytest.approx(round_s, rel=REL)
    assert one["AsyncModelAverage"]["predicted_step_s"] == pytest.approx(
        local + local / round_s * (thread + big / 4 * ew), rel=REL)
    # ... whose passes run beside compute at the weight mix's measured rate: rounds spaced by
    # their wall time, the CPU they take unchanged
    slow = _rows(_measured(hosts=1, local_size=4, grad_bytes=big, elementwise_s_per_element=ew,
                           mix_rate_beside_compute=0.25), None, intra=intra)["AsyncModelAverage"]
    round_s = intra.ring(32) + thread / 0.25 / 0.1
    assert slow["round_s"] == pytest.approx(round_s, rel=REL)
    assert slow["predicted_step_s"] == pytest.approx(local + local / round_s * (thread + big / 4 * ew), rel=REL)
    # ... and where the arena's round was timed, its own time alone, its rate beside compute
    # and the compute it takes (stretch per second of it) replace the passes
    per, rate, stretch = 3e-9, 0.4, 0.5
    timed = _rows(_measured(hosts=1, local_size=4, grad_bytes=big, elementwise_s_per_element=ew,
                            mix_rate_beside_compute=0.25, arena_round_s_per_element=per,
                            arena_rate_beside_compute=rate, arena_stretch=stretch), None, intra=intra)
    row = timed["AsyncModelAverage"]
    round_s = intra.ring(32) + per * big / 4 / rate / 0.1
    assert row["round_s"] == pytest.approx(round_s, rel=REL)
    assert row["predicted_step_s"] == pytest.approx(
        local + local / round_s * (stretch * per * big / 4 + big / 4 * ew), rel=REL)
    # (the timed round changes what the step pays over its local compute)
    assert row["predicted_step_s"] - local != pytest.approx(slow["predicted_step_s"] - local, rel=0.2)


def test_model_monotonic_in_bandwidth():
    """More bandwidth never predicts a slower step, and no step is below the local compute."""
    from rumor.advisor.model import predict, predict_torch

    for kw in ({}, {"buffer_bytes": 4096, "buffer_broadcast_s": 1e-4}):
        m = _realistic(**kw)
        floor = m["forward_s"] + m["backward_s"] + m["optimizer_s"]
        prev = None
        for B in RATES:
            link = _link(B)
            rows = {r["algorithm"]: r["predicted_step_s"] for r in predict(m, None, link, adam=True)}
            rows["torch DDP"] = predict_torch(m, None, link)["predicted_step_s"]
            assert len(rows) == 15
            for name, t in rows.items():
                assert t >= floor * (1 - 1e-12), (name, B)
                # AsyncModelAverage's rounds come more often on a faster link (each costs
                # the same CPU): its step may grow, but by at most one round's passes per step
                if name == "AsyncModelAverage":
                    assert t <= floor + 5 * m["grad_bytes"] / 4 * m["elementwise_s_per_element"]
                elif prev is not None:
                    assert t <= prev[name] * (1 + 1e-12), (name, B)
            prev = rows


def test_ranking_follows_the_link():
    """Fast link: compute-bound, exact allreduce first. Slow link: every exact algorithm falls
    behind the ones that send less, and the predicted speed-up over torch DDP grows."""
    from rumor.advisor.model import predict, predict_torch, rank_rows

    m = _realistic()
    ranked = {}
    for B in (RATES[0], RATES[-1]):
        link = _link(B)
        rows = rank_rows(predict(m, None, link, adam=False))
        tref = predict_torch(m, None, link)["predicted_step_s"]
        ranked[B] = ([r["algorithm"] for r in rows], {r["algorithm"]: tref / r["predicted_step_s"] for r in rows})
    fast, slow = ranked[RATES[-1]][0], ranked[RATES[0]][0]
    assert fast[0] == "GradientAllReduce"
    assert slow[0] != "GradientAllReduce" and slow.index("GradientAllReduce") > slow.index("ByteGrad")
    assert slow.index("PowerSGD rank 4") < slow.index("GradientAllReduce")
    assert slow.index("LocalSGD every 8") < slow.index("GradientAllReduce")
    assert ranked[RATES[0]][1][slow[0]] > 1.5 > ranked[RATES[-1]][1][fast[0]]


def test_bucket_plan_follows_ready_order():
    from rumor.advisor.model import _buckets, bucket_plan, torch_bucket_plan

    mb = 1024 * 1024
    ready = [0.3, 0.1, 0.2, 0.4]
    nbytes = [mb // 2, mb // 2, mb // 2, 30 * mb]
    # ready order 1, 2, 0, 3, every gradient far (100 ms) from the last: one bucket each
    assert bucket_plan(ready, nbytes) == [[1], [2], [0], [3]]
    # no gap splits: the first bucket holds 1 MB (params 1 and 2), then 0, then 3 alone
    assert _buckets(ready, nbytes, gap_s=None) == [(0.2, mb), (0.3, mb // 2), (0.4, 30 * mb)]
    # the order and the gaps are the first iteration's, the ready times the measured ones
    first = [0.0102, 0.01, 0.0101, 0.02]
    assert bucket_plan(ready, nbytes, first=first) == [[1, 2], [0], [3]]
    # the wrapper's default plan (rumor.algorithms.base.default_bucket_plan) agrees
    import torch
    from rumor.algorithms.base import default_bucket_plan

    params = [torch.empty(n // 4) for n in nbytes]
    order = [1, 2, 0, 3]
    want = default_bucket_plan([params[i] for i in order], 25 * mb, mb, frozenset({2, 3}))
    assert bucket_plan(ready, nbytes, first=first) == [[order[j] for j in b] for b in want]
    # torch DDP closes a bucket once it reaches its cap: 1 MiB first (1, 2), then 25 MB (0, 3)
    assert torch_bucket_plan(ready, nbytes) == [[1, 2], [0, 3]]


# ==== inside a rank =================================================================================

def _advise_rank(opt_name):
    import hashlib

    import torch

    import rumor
    from rumor.testing import models

    torch.set_num_threads(1)
    rumor.init()
    model = models.build("mlp25m", seed=0, scale=1 / 32)
    opt = (torch.optim.Adam if opt_name == "adam" else torch.optim.SGD)(model.parameters(), lr=0.01,
                                                                       **({} if opt_name == "adam" else {"momentum": 0.9}))
    batch = models.batch(model, 4, shard=rumor.rank())
    opt.zero_grad()
    models.loss(model(batch[0]), batch[1]).backward()
    opt.step()  # so that the optimizer has state to restore

    def digest():
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
            h.update(p.grad.numpy().tobytes())
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    h.update(v.numpy().tobytes())
        return h.hexdigest()

    before = digest()
    advice = rumor.advise(model, opt, batch, steps=2, warmup=1, link_mb=1, link_reps=2, print_table=False)
    errors = {}
    for name, kw in {"steps": dict(steps=0), "batch": dict(sample_batch=[1, 2, 3]),
                     "link_mb": dict(link_mb=0), "loss_fn": dict(loss_fn=3)}.items():
        args = dict(model=model, optimizer=opt, sample_batch=batch, print_table=False)
        args.update(kw)
        try:
            rumor.advise(**args)
            errors[name] = None
        except (TypeError, ValueError) as e:
            errors[name] = (type(e).__name__, str(e))
    return dict(rows=advice.rows, torch=advice.torch, measured=advice.measured, table=advice.table,
                same=before == digest(), errors=errors, trained=_train_rows(advice, opt_name),
                grad_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                elements=sum(p.numel() for p in model.parameters()))


def _train_rows(advice, opt_name):
    """Every row's algorithm, built from the row and from the text it prints, trains a fresh
    model for one step: per row, whether the text builds the same thing, whether the step
    moved every weight to finite values, and a digest of the weights (to compare ranks)."""
    import hashlib

    import torch

    import rumor
    from rumor import algorithms as A
    from rumor.advisor import build_algorithm
    from rumor.testing import models

    out = {}
    batch = models.batch(models.build("mlp25m", seed=0, scale=1 / 32), 4, shard=rumor.rank(), step=1)
    for row in advice.rows:
        model = models.build("mlp25m", seed=0, scale=1 / 32)
        start = [p.detach().clone() for p in model.parameters()]
        if row["ctor"]["cls"] == "OneBitAdamAlgorithm":
            opt = rumor.optim.OneBitAdamOptimizer(model.parameters(), lr=1e-3)
            algo = build_algorithm(row, opt)
            same_text = "OneBitAdamAlgorithm(optimizer)" in row["kwargs"]
        else:
            opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if opt_name == "adam"
                   else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
            algo = advice.algorithm(row)
            text = row["kwargs"]
            assert text.startswith("algorithm="), text
            again = eval(text[len("algorithm="):], {"torch": torch, **vars(A)})  # noqa: S307
            simple = (bool, int, float, str, type(None), torch.dtype)
            same_text = type(again) is type(algo) and (
                {k: v for k, v in vars(again).items() if not k.startswith("_") and isinstance(v, simple)}
                == {k: v for k, v in vars(algo).items() if not k.startswith("_") and isinstance(v, simple)})
        ddp = rumor.DistributedDataParallel(model, optimizer=opt, algorithm=algo)
        opt.zero_grad()
        models.loss(ddp(batch[0]), batch[1]).backward()
        opt.step()
        if hasattr(algo, "finish"):
            algo.finish()
        params = [p.detach() for p in model.parameters()]
        h = hashlib.sha256()
        for p in params:
            h.update(p.numpy().tobytes())
        out[row["algorithm"]] = dict(
            same_text=same_text, cls=type(algo).__name__,
            moved=all(not torch.equal(a, b) for a, b in zip(start, params)),
            finite=all(bool(torch.isfinite(p).all()) for p in params), digest=h.hexdigest())
        del ddp, opt, model, algo
    return out


# Rows whose ranks hold the same weights after one step (exact and compressed averages give every
# rank the same bits; LocalSGD averages right after its first step; AsyncModelAverage's finish()
# leaves every rank with the same weights).
AGREE_AFTER_ONE_STEP = {"exact", "compressed"}
AGREE_ALSO = {"LocalSGD every 8", "AsyncModelAverage"}


def _check(res, hosts, local, adam):
    r0 = res[0]
    for r in res:
        assert r["rows"] == r0["rows"] and r["torch"] == r0["torch"], "ranks disagree on the table"
        assert r["same"], "the model or the optimizer was not restored"
        for name in ("steps", "batch", "link_mb"):
            assert r["errors"][name] is not None and r["errors"][name][0] == "ValueError", (name, r["errors"][name])
        assert r["errors"]["loss_fn"][0] == "TypeError" and "loss_fn" in r["errors"]["loss_fn"][1]
    m = r0["measured"]
    assert (m["ranks"], m["hosts"], m["local_size"]) == (len(res), hosts, local)
    assert m["grad_bytes"] == r0["grad_bytes"] and m["grad_elements"] == r0["elements"]
    assert m["forward_s"] > 0 and m["backward_s"] > 0 and m["optimizer_s"] > 0
    assert 0 < m["last_ready_s"]
    assert sum(b for _, b in m["buckets"]) == m["grad_bytes"]
    for key, present in (("intra", local > 1), ("inter", hosts > 1)):
        if present:
            assert m[key]["bandwidth_Bps"] > 0 and m[key]["latency_s"] >= 0 and m[key]["ranks"] > 1
        else:
            assert m[key] is None
    several = hosts > 1 and local > 1
    assert (0.1 <= m["local_rate_beside_compute"] <= 1.0) if several else m["local_rate_beside_compute"] == 1.0
    for key in ("intra_ends", "intra_broadcast"):  # the legs around the leaders: hosts of several ranks
        if local > 1:
            assert m[key]["bandwidth_Bps"] > 0 and m[key]["latency_s"] >= 0, key
            assert m[key]["samples"][-1][0] >= m["intra"]["samples"][-1][0], key
        else:
            assert m[key] is None, key
    alone = hosts == 1 and local > 1  # every rank on one host: the weight mix and loopback TCP beside compute
    # (and AsyncModelAverage's round in the shared arena, which these tests' jobs use)
    for key in ("mix_s_per_byte", "mix_rate_beside_compute", "mix_stretch", "loopback", "loopback_rate_beside_compute",
                "loopback_stretch", "arena_round_s_per_element", "arena_rate_beside_compute", "arena_stretch"):
        assert (key in m) == alone, key
    if alone:
        assert m["mix_s_per_byte"] > 0 and m["loopback"]["bandwidth_Bps"] > 0 and m["loopback"]["latency_s"] >= 0
        assert m["arena_round_s_per_element"] > 0
        for key in ("mix_rate_beside_compute", "loopback_rate_beside_compute", "arena_rate_beside_compute"):
            assert 0.1 <= m[key] <= 1.0, key
        for key in ("mix_stretch", "loopback_stretch", "arena_stretch"):
            assert 0.0 <= m[key] <= 2.0, key
    if hosts > 1:  # the swap with one peer and the ring beside compute are probed between hosts only
        assert m["pair"]["ranks"] == 2 and m["pair"]["bandwidth_Bps"] > 0 and m["pair"]["latency_s"] >= 0
        assert 0.1 <= m["comm_rate_beside_compute"] <= 1.0
    else:
        assert m["pair"] is None and m["comm_rate_beside_compute"] == 1.0
    for c in m["codecs"].values():
        assert c["encode_s_per_element"] > 0 and c["decode_s_per_element"] > 0
    assert m["codecs"]["ByteGrad"]["wire_bytes_per_element"] == pytest.approx(1.0, abs=0.01)
    assert m["codecs"]["1-bit"]["wire_bytes_per_element"] == pytest.approx(0.125, abs=0.01)
    rows = r0["rows"]
    steps = [r["predicted_step_s"] for r in rows]
    # ordered by predicted step; only predictions within 1% of each other (a tie) may be swapped,
    # and then the exact algorithm comes before the compressed one before the decentralized one
    from rumor.advisor.model import PER_STEP_SYNC, UNSYNCHRONIZED_STEPS, rank_rows
    assert rank_rows(rows) == rows
    for a, b in zip(steps, steps[1:]):
        assert b >= a / 1.0501
    compute = m["forward_s"] + m["backward_s"] + m["optimizer_s"]
    names = [r["algorithm"] for r in rows]
    assert len(set(names)) == len(names)
    assert ("1-bit Adam" in names) == adam
    assert {"GradientAllReduce", "ByteGrad", "QSGD", "fp16", "bf16", "Decentralized all",
            "LowPrecisionDecentralized", "PowerSGD rank 4", "LocalSGD every 8", "DiLoCo H=32",
            "StreamingDiLoCo H=32", "AsyncModelAverage"} <= set(names)
    # the ranks' mean step (each rank's mean over its compute steps)
    assert 0 < m["free_step_s"]
    for r in rows:
        # steps that synchronize nothing run at the ranks' mean step, the others at the slowest's
        floor = m["free_step_s"] if r["kind"] in UNSYNCHRONIZED_STEPS else compute
        assert r["predicted_step_s"] >= floor * (1 - 1e-12), r["algorithm"]
        assert r["speedup_over_torch"] == pytest.approx(r0["torch"]["predicted_step_s"] / r["predicted_step_s"])
        assert r["caveat"] and r["kind"] in PER_STEP_SYNC + UNSYNCHRONIZED_STEPS
        assert r["period"] == {"LocalSGD every 8": 8, "DiLoCo H=32": 32, "StreamingDiLoCo H=32": 32}.get(
            r["algorithm"], 1)
        assert r["ctor"]["cls"] in r["kwargs"]
        for rr in res:
            t = rr["trained"][r["algorithm"]]
            assert t["same_text"] and t["cls"] == r["ctor"]["cls"], (r["algorithm"], t)
            assert t["moved"] and t["finite"], (r["algorithm"], t)
        if r["kind"] in AGREE_AFTER_ONE_STEP or r["algorithm"] in AGREE_ALSO:
            assert len({rr["trained"][r["algorithm"]]["digest"] for rr in res}) == 1, r["algorithm"]
    # the ranks' replicas differ after a step of their own (no average yet): DiLoCo trained alone
    assert len({rr["trained"]["DiLoCo H=32"]["digest"] for rr in res}) == len(res)
    assert rows[0]["kwargs"] in r0["table"] and "measured" in r0["table"]


def test_advise_one_host_two_ranks_sgd():
    res = harness.run(_advise_rank, 2, timeout=240, args=("sgd",))
    _check(res, hosts=1, local=2, adam=False)


def test_advise_two_hosts_adam():
    rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
    res = harness.run(_advise_rank, 4, timeout=300, args=("adam",), rank_env=rank_env)
    _check(res, hosts=2, local=2, adam=True)


SCRIPT = textwrap.dedent("""
    import torch
    from rumor.testing import models

    def rumor_advise():
        import rumor
        m = models.build("transformer", seed=0, scale=1 / 32)
        return dict(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.01),
                    batch=models.batch(m, 2, shard=rumor.rank()))

    if __name__ == "__main__":
        raise SystemExit("the script's own entry point must not run")
""")


def test_advise_command_line():
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        out = os.path.join(d, "advice.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RUMOR_", "TORCHELASTIC_"))
               and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", RUMOR_TIMEOUT="60")
        cmd = [sys.executable, "-m", "rumor.advisor", "--nproc-per-node", "2", "--steps", "2", "--warmup", "1",
               "--link-mb", "1", "--json", out, script]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150, env=env,
                           start_new_session=True)
        assert p.returncode == 0, p.stdout[-4000:]
        assert "rumor advisor: 2 ranks on 1 host(s)" in p.stdout and "suggestion:" in p.stdout
        with open(out) as f:
            data = json.load(f)
        steps = [r["predicted_step_s"] for r in data["rows"]]
        assert all(b >= a / 1.0501 for a, b in zip(steps, steps[1:])) and data["measured"]["ranks"] == 2

        bad = os.path.join(d, "nohook.py")
        with open(bad, "w") as f:
            f.write("x = 1\n")
        p = subprocess.run([sys.executable, "-m", "rumor.advisor", bad], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60, env=env)
        assert p.returncode != 0 and "rumor_advise()" in p.stdout


EXAMPLES = os.path.abspath(os.path.join(harness.HERE, os.pardir, os.pardir, "examples"))


def test_advisor_on_an_ordinary_script():
    """`python -m rumor.advisor --nproc-per-node 2 examples/ddp_cnn.py`: no rumor_advise() in the
    script; it runs as __main__ with its own arguments and is measured at its first training
    forward, before any of its steps completes."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "advice.json")
        cmd = [sys.executable, "-m", "rumor.advisor", "--nproc-per-node", "2", "--steps", "2", "--warmup", "1",
               "--link-mb", "1", "--json", out, os.path.join(EXAMPLES, "ddp_cnn.py"), "--algorithm", "qsgd",
               "--batch-size", "8"]
        text = harness.launch(cmd, d)
        assert "qsgd on 2 ranks (cpu), batch 8 per rank" in text, text[-4000:]  # the script's own args
        assert "rumor advisor: 2 ranks on 1 host(s)" in text and "suggestion:" in text, text[-4000:]
        assert "step 1 loss" not in text, text[-4000:]
        with open(out) as f:
            data = json.load(f)
        # The small CNN: 2 conv + 2 linear layers, weights and biases.
        assert data["measured"]["params"] == 8 and data["measured"]["ranks"] == 2
        assert data["measured"]["grad_elements"] == (3 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (2048 * 64 + 64) + (64 * 10 + 10)


PLAIN_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import rumor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    ddp = rumor.DistributedDataParallel(model)     # no optimizer=: the advisor finds it at step()
    decoy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.123)
    with torch.no_grad():
        ddp(torch.zeros(2, 5))                     # an evaluation forward: not a training step
    for step in range(int(sys.argv[1])):
        x = torch.full((7, 5), float(step))
        opt.zero_grad()
        decoy.step()
        torch.nn.functional.cross_entropy(ddp(x), torch.zeros(7, dtype=torch.long)).backward()
        opt.step()
        print(f"trained step {step}")
""")


def test_advise_script_finds_model_optimizer_and_batch(tmp_path, capsys):
    """The recorder in place of the wrapper: the plain model, the optimizer whose step() moved
    the model's parameters (not the other one), the batch of the step measured, and at most one
    step of the script run; the wrapper class is put back afterwards."""
    import torch

    import rumor
    from rumor.advisor.script import advise_script, stand_in_loss

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    seen = {}

    def run_advise(model, optimizer, batch, loss_fn):
        seen.update(model=model, optimizer=optimizer, batch=batch)
        loss_fn(model, batch).backward()
        seen["grads"] = [p.grad is not None for p in model.parameters()]
        return "the advice"

    assert advise_script(str(script), ["50"], run_advise) == "the advice"
    assert capsys.readouterr().out.splitlines() == ["trained step 0"]
    assert type(seen["model"]) is torch.nn.Sequential
    assert isinstance(seen["optimizer"], torch.optim.Adam) and seen["optimizer"].defaults["lr"] == 0.123
    args, kwargs = seen["batch"]
    assert kwargs == {} and torch.equal(args[0], torch.full((7, 5), 1.0))  # the second step's batch
    assert seen["grads"] == [True] * 4
    _wrapper_constructs_again(rumor)
    out = stand_in_loss(seen["model"], ((torch.ones(2, 5),), {}))
    assert torch.allclose(out, seen["model"](torch.ones(2, 5)).mean())


def test_advise_script_without_the_wrapper(tmp_path):
    import rumor
    from rumor.advisor.script import advise_script

    script = tmp_path / "nowrap.py"
    script.write_text("import torch\nprint(torch.zeros(1))\n")
    with pytest.raises(SystemExit, match="never wrapped a model in rumor.DistributedDataParallel"):
        advise_script(str(script), [], lambda *a: pytest.fail("advised"))
    _wrapper_constructs_again(rumor)


def _wrapper_constructs_again(rumor):
    """After advise_script the class is as it was and builds itself with its arguments (a __new__
    assigned and deleted on the class had left object.__new__ refusing them)."""
    import torch

    ddp = rumor.DistributedDataParallel
    assert "__new__" not in vars(ddp) and vars(ddp)["__init__"].__qualname__ == "DistributedDataParallel.__init__"
    made = ddp.__new__(ddp, torch.nn.Linear(2, 1), optimizer=None)
    assert type(made) is ddp


def test_advisor_help():
    p = subprocess.run([sys.executable, "-m", "rumor.advisor", "--help"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60)
    assert p.returncode == 0, p.stdout[-4000:]
    assert p.stdout.startswith("usage: python -m rumor.advisor") and "--nproc-per-node" in p.stdout


# Run in a fresh interpreter: importing every submodule (compat's aliases, testing helpers) is not
# something the pytest process should keep.
REBIND_CHECK = textwrap.dedent("""
    import importlib, inspect, pkgutil, sys
    import rumor

    def packages():
        return {n: m for n, m in list(sys.modules.items())
                if (n == "rumor" or n.startswith("rumor.")) and hasattr(m, "__path__")}

    # A package's attributes that are not modules: a submodule of the same name, once imported,
    # would replace one (as rumor/advise.py once replaced the function rumor.advise).
    before = {n: {k: v for k, v in vars(p).items() if not inspect.ismodule(v)} for n, p in packages().items()}
    for info in pkgutil.walk_packages(rumor.__path__, "rumor.", onerror=lambda name: None):
        try:
            importlib.import_module(info.name)
        except Exception:  # optional dependencies (ipyparallel, optuna, redis, ...) may be missing
            pass
    for n, attrs in before.items():
        p = sys.modules[n]
        for k, v in attrs.items():
            assert getattr(p, k, None) is v, f"{n}.{k} was rebound to {getattr(p, k, None)!r}"
    assert inspect.isfunction(rumor.advise) and rumor.advise is sys.modules["rumor.advisor"].advise
    try:
        import rumor.advise  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("rumor.advise is importable as a module again")
    assert inspect.isfunction(rumor.advise)
    print("ok")
""")


def test_importing_submodules_keeps_rumor_advise_a_function():
    p = subprocess.run([sys.executable, "-c", REBIND_CHECK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("ok"), p.stdout[-4000:]


def test_ties_prefer_exact():
    """A less exact algorithm must be predicted faster by its kind's margin (1% compressed, 2%
    decentralized, 5% periodic or asynchronous) to rank above a more exact one."""
    from rumor.advisor.model import rank_rows

    rows = [dict(algorithm="Decentralized all", kind="decentralized", predicted_step_s=0.999),
            dict(algorithm="ByteGrad", kind="compressed", predicted_step_s=1.0),
            dict(algorithm="GradientAllReduce", kind="exact", predicted_step_s=1.004),
            dict(algorithm="QSGD", kind="compressed", predicted_step_s=0.5),
            dict(algorithm="AsyncModelAverage", kind="async", predicted_step_s=0.97),
            dict(algorithm="LocalSGD every 8", kind="periodic", predicted_step_s=0.9)]
    rows = rank_rows(rows)
    assert [r["algorithm"] for r in rows] == ["QSGD", "LocalSGD every 8", "GradientAllReduce", "ByteGrad",
                                              "AsyncModelAverage", "Decentralized all"]


def test_gradient_copies_and_the_comm_threads_work_taken_from_compute():
    """The wrapper copies each gradient into its bucket during backward (torch DDP also copies
    it back out after the last bucket); the measured share of the comm thread's codec work is
    taken from compute; the periodic algorithms' local steps copy nothing. What compute loses
    before a bucket is ready (the copies so far, the CPU of buckets that communicated beside
    backward) makes that bucket late by as much."""
    from rumor.advisor.model import Link, predict_torch

    B, a = 125e6, 1e-4
    inter = Link(n=4, bandwidth_Bps=B, latency_s=a)
    ring = lambda nbytes, n=4: 2 * (n - 1) / n * nbytes / B + 2 * (n - 1) * a  # noqa: E731
    copy = 2e6 * 1e-9  # 2 M elements at 1 ns
    m = _measured(copy_s_per_element=1e-9)
    rows = _rows(m, inter)
    busy = 0.02 + copy
    t1 = 0.005 + copy / 8 + ring(1e6)  # after its own copy (1 of 8 MB)
    t2 = max(t1, 0.02 + copy) + ring(7e6)  # the second bucket is ready after both copies
    assert rows["GradientAllReduce"]["predicted_step_s"] == pytest.approx(0.01 + max(busy, t2) + 0.005, rel=REL)
    assert predict_torch(m, None, inter)["predicted_step_s"] == pytest.approx(
        0.01 + max(busy, t2) + copy + 0.005, rel=REL)
    assert rows["LocalSGD every 8"]["predicted_step_s"] == pytest.approx(0.035 + ring(8e6) / 8, rel=REL)
    # half of the codec work comes out of backward, the first bucket's (beside backward) before
    # the second is ready
    codecs = _codecs()
    codecs["ByteGrad"].update(encode_s_per_element=1e-9, decode_s_per_element=2e-9)
    bg = _rows(_measured(codecs=codecs, comm_work_steal=0.5), inter)["ByteGrad"]
    work = lambda el: el * (1e-9 * 1.25 + 2e-9 * 1.75)  # noqa: E731
    busy = 0.02 + 0.5 * (work(0.25e6) + work(1.75e6))
    s1 = 0.005 + work(0.25e6)
    t1 = s1 + ring(0.25e6)
    assert t1 < 0.02  # all of it beside backward
    t2 = max(t1, 0.02 + 0.5 * work(0.25e6)) + work(1.75e6) + ring(1.75e6)
    assert bg["predicted_step_s"] == pytest.approx(0.01 + max(busy, t2) + 0.005, rel=REL)
    # the network's CPU: the first bucket's share (1 of 8 MB) delays the second; only the part of
    # a bucket's exchange that runs beside backward counts
    c = 1e-9  # per byte sent
    g = _rows(_measured(net_cost_s_per_byte=c, backward_s=0.008), inter)["GradientAllReduce"]
    net = c * 1.5 * 8e6  # a ring of 4 sends 1.5 x the bytes
    s1 = 0.005
    t1 = s1 + ring(1e6)
    share = (0.008 - s1) / (t1 - s1)  # of the first bucket's exchange, beside backward
    assert 0 < share < 1
    t2 = max(t1, 0.02 + net / 8 * share) + ring(7e6)
    assert g["predicted_step_s"] == pytest.approx(0.01 + max(0.008 + net, t2) + 0.005, rel=REL)


def test_per_step_synchronization_waits_for_the_slowest_rank():
    """Algorithms that synchronize every step (and torch DDP) pay each step's slowest rank over
    the median compute; periodic and asynchronous ones do not. The bucketed ones pay it where
    compute bounds the step: their buckets' ready times are already the last rank's, so a step
    bound by its communication pays nothing more."""
    from rumor.advisor.model import Link, predict_torch

    for backward, bound, B in ((0.5, "compute", 125e6), (0.02, "communication", 12.5e6)):
        inter = Link(n=4, bandwidth_Bps=B, latency_s=1e-4)
        base, slow = _measured(backward_s=backward), _measured(backward_s=backward, straggler_s=0.05)
        r0, r1 = _rows(base, inter), _rows(slow, inter)
        for name, row in r0.items():
            extra = 0.05 if row["kind"] == "decentralized" or (
                row["kind"] in ("exact", "compressed") and bound == "compute") else 0.0
            assert r1[name]["predicted_step_s"] == pytest.approx(row["predicted_step_s"] + extra, rel=REL), (name, bound)
        assert {r["kind"] for r in r0.values()} >= {"exact", "compressed", "decentralized", "periodic", "async"}
        torch_extra = 0.05 if bound == "compute" else 0.0
        assert predict_torch(slow, None, inter)["predicted_step_s"] == pytest.approx(
            predict_torch(base, None, inter)["predicted_step_s"] + torch_extra, rel=REL), bound
    # bound by communication: every bucketed row's last bucket ends after backward + the wait
    # (ByteGrad's, the shortest: 1.75 MB, 210 ms on the ring)
    assert min(r0[k]["exposed_comm_s"] for k in ("GradientAllReduce", "ByteGrad", "fp16")) > 0.05


def test_compute_steps_start_after_the_sync():
    """Each measured or warm-up compute step starts after sync() (advise passes a barrier, so
    the ranks' steps start together as a wrapper that synchronizes every step makes them), and
    sync's own time is not counted in the step."""
    import time

    import torch

    from rumor.advisor.measure import default_loss, measure_compute

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(3, 4), torch.tensor([0, 1, 0]))
    calls = []

    def sync():
        calls.append(1)
        time.sleep(0.25)

    res = measure_compute(model, opt, batch, default_loss, steps=3, warmup=2, sync=sync)
    totals = res[-1]
    assert len(calls) == 5 and len(totals) == 3
    assert max(totals) < 0.25, totals  # the 250 ms in sync() are outside every step's time


def test_compute_steps_start_without_gradients():
    """Each compute step starts as a training step after torch's default zero_grad() does: no
    gradients, so backward makes fresh ones (kept gradients would be added into, a pass that
    training does not pay)."""
    import torch

    from rumor.advisor.measure import default_loss, measure_compute

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(3, 4), torch.tensor([0, 1, 0]))
    seen = []

    def loss_fn(m, b):
        seen.append([p.grad is None for p in m.parameters()])
        return default_loss(m, b)

    measure_compute(model, opt, batch, loss_fn, steps=3, warmup=2)
    assert seen == [[True, True]] * 5, seen
