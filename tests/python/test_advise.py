"""rumor.advise: the measurements, the table, the prediction model, the command line.

* The link-bound model (rumor.advisor.predict) against step times worked out by hand from
  synthetic measurements (exact arithmetic on floats, compared with a relative 1e-12).
* The API on 2 ranks of one host and on 2 hosts x 2 ranks (RUMOR_HOST_ID, so the network path
  is TCP over loopback): every rank gets the same table, the measured quantities are what the
  model really holds (gradient bytes exactly) and positive, rows are ordered by predicted step
  (ties within 1% go to the more exact algorithm),
  no prediction is below the measured compute, 1-bit Adam appears only for Adam, and the model
  and optimizer come back bit for bit.
* ``python -m rumor.advise --nproc-per-node 2 script.py`` with a script defining rumor_advise().
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


def test_prediction_model_by_hand():
    from rumor.advisor import Link, predict, predict_torch

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
    # torch DDP: the flat fp32 ring, as GradientAllReduce with one rank per host
    assert predict_torch(m, None, inter)["predicted_step_s"] == pytest.approx(expect, rel=REL)
    # without Adam there is no 1-bit Adam row; with several ranks per host a hierarchical row
    rows2 = {r["algorithm"] for r in predict(_measured(ranks=8, local_size=2), Link(2, 5e9, 1e-6), inter, adam=False)}
    assert "1-bit Adam" not in rows2 and "GradientAllReduce hierarchical" in rows2


def test_bucket_plan_follows_ready_order():
    from rumor.advisor import _buckets

    mb = 1024 * 1024
    ready = [0.3, 0.1, 0.2, 0.4]
    nbytes = [mb // 2, mb // 2, mb // 2, 30 * mb]
    # ready order 1, 2, 0, 3: the first bucket holds 1 MB (params 1 and 2), then 0, then 3 alone
    assert _buckets(ready, nbytes) == [(0.2, mb), (0.3, mb // 2), (0.4, 30 * mb)]


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
                same=before == digest(), errors=errors,
                grad_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                elements=sum(p.numel() for p in model.parameters()))


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
    for c in m["codecs"].values():
        assert c["encode_s_per_element"] > 0 and c["decode_s_per_element"] > 0
    assert m["codecs"]["ByteGrad"]["wire_bytes_per_element"] == pytest.approx(1.0, abs=0.01)
    assert m["codecs"]["1-bit"]["wire_bytes_per_element"] == pytest.approx(0.125, abs=0.01)
    rows = r0["rows"]
    steps = [r["predicted_step_s"] for r in rows]
    # ordered by predicted step; only predictions within 1% of each other (a tie) may be swapped,
    # and then the exact algorithm comes before the compressed one before the decentralized one
    from rumor.advisor import rank_rows
    assert rank_rows(rows) == rows
    for a, b in zip(steps, steps[1:]):
        assert b >= a / 1.0101
    compute = m["forward_s"] + m["backward_s"] + m["optimizer_s"]
    names = [r["algorithm"] for r in rows]
    assert len(set(names)) == len(names)
    assert ("1-bit Adam" in names) == adam
    assert {"GradientAllReduce", "ByteGrad", "QSGD", "fp16", "bf16", "Decentralized all",
            "LowPrecisionDecentralized"} <= set(names)
    for r in rows:
        assert r["predicted_step_s"] >= compute * (1 - 1e-12)
        assert r["speedup_over_torch"] == pytest.approx(r0["torch"]["predicted_step_s"] / r["predicted_step_s"])
        assert r["caveat"] and r["kind"] in ("exact", "compressed", "decentralized")
    assert rows[0]["kwargs"] in r0["table"] and "measured" in r0["table"]


def test_advise_one_host_two_ranks_sgd():
    res = harness.run(_advise_rank, 2, timeout=120, args=("sgd",))
    _check(res, hosts=1, local=2, adam=False)


def test_advise_two_hosts_adam():
    rank_env = [{"RUMOR_HOST_ID": h} for h in ("hA", "hA", "hB", "hB")]
    res = harness.run(_advise_rank, 4, timeout=150, args=("adam",), rank_env=rank_env)
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
        cmd = [sys.executable, "-m", "rumor.advise", "--nproc-per-node", "2", "--steps", "2", "--warmup", "1",
               "--link-mb", "1", "--json", out, script]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150, env=env,
                           start_new_session=True)
        assert p.returncode == 0, p.stdout[-4000:]
        assert "rumor advisor: 2 ranks on 1 host(s)" in p.stdout and "suggestion:" in p.stdout
        with open(out) as f:
            data = json.load(f)
        steps = [r["predicted_step_s"] for r in data["rows"]]
        assert all(b >= a / 1.0101 for a, b in zip(steps, steps[1:])) and data["measured"]["ranks"] == 2

        bad = os.path.join(d, "nohook.py")
        with open(bad, "w") as f:
            f.write("x = 1\n")
        p = subprocess.run([sys.executable, "-m", "rumor.advise", bad], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60, env=env)
        assert p.returncode != 0 and "rumor_advise()" in p.stdout


def test_ties_prefer_exact():
    from rumor.advisor import rank_rows

    rows = [dict(algorithm="Decentralized all", kind="decentralized", predicted_step_s=0.999),
            dict(algorithm="ByteGrad", kind="compressed", predicted_step_s=1.0),
            dict(algorithm="GradientAllReduce", kind="exact", predicted_step_s=1.004),
            dict(algorithm="QSGD", kind="compressed", predicted_step_s=0.5)]
    rows = rank_rows(rows)
    assert [r["algorithm"] for r in rows] == ["QSGD", "GradientAllReduce", "ByteGrad", "Decentralized all"]
