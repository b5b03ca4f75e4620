"""Correctness of every collective, dtype and reduce op, on 1 to 4 spawned ranks.

Each test spawns its ranks once and runs a whole batch of cases in them (spawning costs a
couple of seconds per rank on a small machine); a rank records every mismatch it sees and the
test fails listing all of them; the matrix tests have one test id per group of cases (`-k large`),
the selected groups sharing one launch. Expected results are computed locally and exactly: every rank
can generate every other rank's input from the case's key (harness.gen). Where torch's gloo
backend implements the same operation, the ranks also compare against it in the same
processes (init_process_group("gloo") after rumor.init() shares rumor's TCPStore).
"""
from __future__ import annotations

import os
import tempfile
import time

import pytest

import harness
from harness import Checker, check_reduced, dname, gen, reference

OPS = harness.OP_NAMES
SMALL_ALLREDUCE_BYTES = 64 * 1024      # at or below: recursive doubling (Options::small_allreduce_bytes)
LARGE_BROADCAST_BYTES = 512 * 1024     # at or above: scatter + ring allgather (a chain across hosts)
STRIPE_BYTES = 256 * 1024              # the TCP tests stripe messages at least this big over all streams
TCP = {"RUMOR_SHM": "0", "RUMOR_STRIPE_MIN_BYTES": str(STRIPE_BYTES)}  # (the default stripes from 4 MiB)
LARGE = 3 * 1024 * 1024 + 5            # elements: ring path, striping, shm ring wrap-around


def _op(name):
    import rumor

    return getattr(rumor.ReduceOp, name)


def _sizes(dtype, profile):
    import torch

    thr = SMALL_ALLREDUCE_BYTES // torch.tensor([], dtype=dtype).element_size()
    if profile == "full":
        return [0, 1, 7, 1023, thr, thr + 1]
    if profile == "reduced":
        return [0, 1, 1023, thr + 1]
    return [0, 7, thr + 1]


def _dtypes(profile):
    import torch

    if profile == "minimal":
        return [torch.float32, torch.bfloat16, torch.uint8, torch.int64]
    return harness.dtypes()


def _ops(profile):
    return ["SUM", "AVG", "MAX"] if profile == "minimal" else OPS


def _init_gloo():
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def _finish(chk):
    import rumor
    import torch.distributed as dist

    rumor.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return chk.failures, chk.count


# ---- the matrix: every collective x dtype x op x size -------------------------------------------

def _reducing_cases(chk, n, r, profile, key):
    """allreduce, allreduce_, reduce (roots rotate) and reduce_scatter for every dtype, op, size."""
    import rumor

    idx = 0
    for dtype in _dtypes(profile):
        for op in _ops(profile):
            for size in _sizes(dtype, profile):
                idx += 1
                case = f"[{key}] {dname(dtype)} {op} numel={size}"
                inputs = [gen(key, q, dtype, op, size) for q in range(n)]
                x = inputs[r].clone()
                ref = reference(inputs, op)
                try:
                    out = rumor.allreduce(x, op=_op(op))
                    check_reduced(chk, out, ref, op, f"allreduce {case}")
                    chk.equal(x, inputs[r], f"allreduce {case}: input was modified")
                    y = x.clone()
                    ret = rumor.allreduce_(y, op=_op(op))
                    check_reduced(chk, y, ref, op, f"allreduce_ {case}")
                    chk.check(ret is y, f"allreduce_ {case}: did not return its argument")
                    root = idx % n
                    out = rumor.reduce(x, root, op=_op(op))
                    if r == root:
                        check_reduced(chk, out, ref, op, f"reduce(root={root}) {case}")
                    else:
                        chk.equal(out, inputs[r], f"reduce(root={root}) {case} on a non-root")
                    chk.equal(x, inputs[r], f"reduce {case}: input was modified")
                    out = rumor.reduce_scatter(x, op=_op(op))
                    check_reduced(chk, out, ref.tensor_split(n)[r], op, f"reduce_scatter {case}")
                    chk.equal(x, inputs[r], f"reduce_scatter {case}: input was modified")
                except Exception as e:
                    e.add_note(f"while running {case}")
                    raise


def _alltoall_splits(q, n, size):
    """Rank q's uneven splits (some zero) for a case of base size `size`."""
    return [((q * 3 + d * 5 + size) % 4) * (0 if (q + d) % 3 == 1 else 1) + (size % 3) * (d == q)
            for d in range(n)]


def _copying_cases(chk, n, r, profile, key):
    """broadcast(_) from rotating roots, allgather with uneven first dims and 0-row ranks,
    alltoall with default and uneven splits, for every dtype and size."""
    import rumor
    import torch

    idx = 0
    for dtype in _dtypes(profile):
        sizes = _sizes(dtype, profile) + [LARGE_BROADCAST_BYTES // torch.tensor([], dtype=dtype).element_size()]
        for size in sizes:
            idx += 1
            case = f"[{key}] {dname(dtype)} numel={size}"
            try:
                # broadcast, out of place and in place, from a rotating root
                root = idx % n
                inputs = [gen(key + "bc", q, dtype, "COPY", size) for q in range(n)]
                x = inputs[r].clone()
                out = rumor.broadcast(x, root)
                chk.equal(out, inputs[root], f"broadcast(root={root}) {case}")
                chk.equal(x, inputs[r], f"broadcast {case}: input was modified")
                y = x.clone()
                ret = rumor.broadcast_(y, (root + 1) % n)
                chk.equal(y, inputs[(root + 1) % n], f"broadcast_(root={(root + 1) % n}) {case}")
                chk.check(ret is y, f"broadcast_ {case}: did not return its argument")

                # allgather: first dims differ per rank; rank 1 contributes no rows
                cols = 3 if size % 2 else 1
                rows = [0 if (q == 1 and size > 1) else max(size // cols, 0) + q for q in range(n)]
                parts = [gen(key + "ag", q, dtype, "COPY", (rows[q], cols)) for q in range(n)]
                out = rumor.allgather(parts[r].clone())
                chk.equal(out, torch.cat(parts), f"allgather rows={rows} {case}")

                # alltoall, even splits (default) and uneven ones with zeros
                k = max(size // (4 * n), 0) + (idx % 2)
                src = [gen(key + "a2a", q, dtype, "COPY", (k * n, 2)) for q in range(n)]
                out = rumor.alltoall(src[r].clone())
                exp = torch.cat([src[q][r * k:(r + 1) * k] for q in range(n)])
                chk.equal(out, exp, f"alltoall rows={k * n} {case}")
                splits = [_alltoall_splits(q, n, size) for q in range(n)]
                src = [gen(key + "a2av", q, dtype, "COPY", (sum(splits[q]), 3)) for q in range(n)]
                x = src[r].clone()
                out = rumor.alltoall(x, splits[r])
                exp = torch.cat([src[q][sum(splits[q][:r]):sum(splits[q][:r + 1])] for q in range(n)])
                chk.equal(out, exp, f"alltoall splits={splits[r]} {case}")
                chk.equal(x, src[r], f"alltoall {case}: input was modified")
            except Exception as e:
                e.add_note(f"while running {case}")
                raise


def _large_cases(chk, n, r, key):
    """Multi-megabyte messages: ring allreduce, TCP striping, shm ring wrap-around,
    scatter+allgather broadcast from every root."""
    import rumor
    import torch

    for dtype, op in [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.bfloat16, "MAX"),
                      (torch.int64, "SUM"), (torch.uint8, "MIN")]:
        case = f"[{key}] large {dname(dtype)} {op} numel={LARGE}"
        inputs = [gen(key + "L", q, dtype, op, LARGE) for q in range(n)]
        ref = reference(inputs, op)
        x = inputs[r].clone()
        out = rumor.allreduce(x, op=_op(op))
        check_reduced(chk, out, ref, op, f"allreduce {case}")
        # From 3 ranks on one host this takes the direct path, which reads the input in place.
        chk.equal(x, inputs[r], f"allreduce {case}: input was modified")
        if dtype == torch.float32:
            out = rumor.reduce(inputs[r], n - 1, op=_op(op))
            if r == n - 1:
                check_reduced(chk, out, ref, op, f"reduce(root={n - 1}) {case}")
            out = rumor.reduce_scatter(inputs[r], op=_op(op))
            check_reduced(chk, out, ref.tensor_split(n)[r], op, f"reduce_scatter {case}")
    inputs = [gen(key + "Lb", q, torch.float32, "COPY", LARGE) for q in range(n)]
    for root in range(n):
        out = rumor.broadcast(inputs[r], root)
        chk.equal(out, inputs[root], f"[{key}] large broadcast(root={root})")
    parts = [gen(key + "Lag", q, torch.float32, "COPY", (LARGE // n + q, 1)) for q in range(n)]
    chk.equal(rumor.allgather(parts[r]), torch.cat(parts), f"[{key}] large allgather")
    k = LARGE // (n * 2)
    src = [gen(key + "La2a", q, torch.float32, "COPY", (k * n, 2)) for q in range(n)]
    exp = torch.cat([src[q][r * k:(r + 1) * k] for q in range(n)])
    chk.equal(rumor.alltoall(src[r]), exp, f"[{key}] large alltoall")


def _gloo_cases(chk, n, r, key):
    """The same operations through torch.distributed (gloo) on random, non-integer data."""
    import rumor
    import torch
    import torch.distributed as dist

    _init_gloo()
    gops = {"SUM": dist.ReduceOp.SUM, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
            "PROD": dist.ReduceOp.PRODUCT}
    for dtype in [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8]:
        for size in [1, 1023, 20000, 300001]:
            x = gen(key + "gloo", r, dtype, "COPY", size)
            if dtype.is_floating_point:
                x = x / 100  # random reals: sums are inexact, so compare with a tolerance
            for op in ["SUM", "MIN", "MAX", "AVG", "PROD"]:
                if op == "PROD" and (size > 1023 or dtype == torch.uint8):
                    continue
                if op in ("SUM", "AVG", "PROD") and not dtype.is_floating_point:
                    x_op = gen(key + "gloo" + op, r, dtype, op, size)
                else:
                    x_op = x
                want = x_op.clone()
                if op == "AVG":
                    if not dtype.is_floating_point:
                        continue  # gloo has no AVG; the exact integer AVG is covered by the matrix
                    dist.all_reduce(want, op=dist.ReduceOp.SUM)
                    want = want / n
                else:
                    dist.all_reduce(want, op=gops[op])
                got = rumor.allreduce(x_op, op=_op(op))
                what = f"[{key}] vs gloo all_reduce {dname(dtype)} {op} numel={size}"
                if dtype.is_floating_point and op in ("SUM", "AVG", "PROD"):
                    chk.close(got, want, what, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)
                else:
                    chk.equal(got, want, what)
            for root in range(n):
                want = x.clone()
                dist.broadcast(want, src=root)
                chk.equal(rumor.broadcast(x, root), want, f"[{key}] vs gloo broadcast {dname(dtype)} root={root}")
            outs = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(outs, x)
            chk.equal(rumor.allgather(x), torch.cat(outs), f"[{key}] vs gloo all_gather {dname(dtype)} numel={size}")
            m = (size // n) * n
            if m:
                xs = x[:m].contiguous()
                want = torch.empty_like(xs)
                dist.all_to_all_single(want, xs)
                chk.equal(rumor.alltoall(xs), want, f"[{key}] vs gloo all_to_all_single {dname(dtype)} numel={m}")
        dist.barrier()


def _rank_queries(chk, n, r, hosts=None):
    import rumor

    chk.check(rumor.is_initialized(), "is_initialized() is False after init")
    chk.check(rumor.rank() == r, f"rank() = {rumor.rank()}, expected {r}")
    chk.check(rumor.size() == n, f"size() = {rumor.size()}, expected {n}")
    if hosts is None:
        hosts = ["h"] * n
    order = list(dict.fromkeys(hosts))
    local = [q for q in range(n) if hosts[q] == hosts[r]]
    exp = dict(local_rank=local.index(r), local_size=len(local), machine_rank=order.index(hosts[r]),
               machine_size=len(order))
    for name, want in exp.items():
        got = getattr(rumor, name)()
        chk.check(got == want, f"{name}() = {got}, expected {want} (hosts {hosts})")


MATRIX = {
    "queries": lambda chk, n, r, profile, key: _rank_queries(chk, n, r),
    "reducing": _reducing_cases,
    "copying": _copying_cases,
    "large": lambda chk, n, r, profile, key: _large_cases(chk, n, r, key),
    "gloo": lambda chk, n, r, profile, key: _gloo_cases(chk, n, r, key),
}


def matrix_rank(groups, profile: str, key: str):
    """Runs the named groups of MATRIX in order; returns {group: (failures, count)}."""
    import rumor

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    out = harness.run_scenarios(chk, groups, MATRIX, n, r, profile, key)
    _finish(chk)
    return out


# One test id per group of cases (`-k reducing`); the selected groups of one test's ranks run in
# one launch (harness.batch), as a whole batch did before.
BASIC = ["queries", "reducing", "copying", "large"]


def _matrix(request, batches, group, profile, key, world_size, **run):
    __tracebackhide__ = True
    res = harness.batch(batches, key, lambda: harness.run(
        matrix_rank, world_size, timeout=240, args=(harness.selected(request, "group"), profile, key), **run))
    harness.assert_no_failures(harness.scenario_results(res, group), f"[{key}] {group}")


SHM = [(n, g) for n in (1, 2, 3, 4) for g in BASIC + (["gloo"] if n > 1 else [])]


@pytest.mark.parametrize("world_size,group", SHM, ids=[f"{n}-{g}" for n, g in SHM])
def test_matrix_shared_memory(world_size, group, request, batches):
    """Every collective x dtype x op x size; the default transport (shared memory on one host),
    plus a comparison with gloo."""
    _matrix(request, batches, group, "full", f"shm{world_size}", world_size)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("group", BASIC)
def test_matrix_tcp(world_size, group, request, batches):
    """The same over TCP on one host (RUMOR_SHM=0), default two streams per peer (three ranks
    over TCP: see the socket-streams tests)."""
    _matrix(request, batches, group, "reduced", f"tcp{world_size}", world_size, env=TCP)


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("group", BASIC)
def test_matrix_tcp_socket_streams(streams, group, request, batches):
    """One and four TCP streams per peer pair; the large cases stripe messages >= 256 KiB."""
    _matrix(request, batches, group, "minimal", f"streams{streams}", 3,
            env={**TCP, "RUMOR_SOCKET_STREAMS": str(streams)})


@pytest.mark.parametrize("group", BASIC)
def test_matrix_small_shm_ring(group, request, batches):
    """A 64 KiB shared-memory ring: every large message wraps around the ring many times."""
    _matrix(request, batches, group, "minimal", "smallring", 3, env={"RUMOR_SHM_RING_BYTES": str(64 * 1024)})


# ---- allreduce algorithms ------------------------------------------------------------------------

def algorithms_rank(key: str, hosts):
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    _rank_queries(chk, n, r, hosts)
    variants = [("default", {}), ("ring", {"algorithm": "ring"}),
                ("recursive_doubling", {"algorithm": "recursive_doubling"}),
                ("hierarchical=True", {"hierarchical": True}), ("algorithm=hierarchical", {"algorithm": "hierarchical"})]
    for vname, kw in variants:
        dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
        if vname in ("default", "algorithm=hierarchical"):
            dtypes = [torch.float32, torch.int32]  # the alias; "default" is the matrix's subject
        for dtype in dtypes:
            sizes = [0, 1, 3, 7, 1023, SMALL_ALLREDUCE_BYTES // torch.tensor([], dtype=dtype).element_size() + 1]
            if dtype == torch.float32:
                sizes.append(300001)  # > 256 KiB: striped on TCP, several shm ring fills
            for op in OPS:
                for size in sizes:
                    case = f"[{key}] allreduce {vname} {dname(dtype)} {op} numel={size}"
                    inputs = [gen(key + vname, q, dtype, op, size) for q in range(n)]
                    ref = reference(inputs, op)
                    try:
                        x = inputs[r].clone()
                        check_reduced(chk, rumor.allreduce(x, _op(op), **kw), ref, op, case)
                        chk.equal(x, inputs[r], f"{case}: input was modified")
                        if size in (7, 1023):
                            rumor.allreduce_(x, _op(op), **kw)
                            check_reduced(chk, x, ref, op, case + " (in place)")
                            h = rumor.allreduce_nonblocking(inputs[r], _op(op), **kw)
                            check_reduced(chk, h.wait(), ref, op, case + " (nonblocking)")
                    except Exception as e:
                        e.add_note(f"while running {case}")
                        raise
    # The large-message ring with every op on a 3M-element float tensor, hierarchical too.
    for vname, kw in [("ring", {"algorithm": "ring"}), ("hierarchical", {"hierarchical": True})]:
        for op in ["SUM", "AVG"]:
            inputs = [gen(key + "big", q, torch.float32, op, LARGE) for q in range(n)]
            check_reduced(chk, rumor.allreduce(inputs[r], _op(op), **kw), reference(inputs, op), op,
                          f"[{key}] allreduce {vname} float32 {op} numel={LARGE}")
    if n > 1:
        _init_gloo()
        import torch.distributed as dist

        x = gen(key + "gl", r, torch.float32, "COPY", 100003) / 7
        want = x.clone()
        dist.all_reduce(want)
        for vname, kw in variants:
            chk.close(rumor.allreduce(x, rumor.ReduceOp.SUM, **kw), want, f"[{key}] {vname} vs gloo", rtol=1e-5, atol=1e-4)
    return _finish(chk)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_algorithms_one_host(world_size):
    """ring / recursive_doubling / hierarchical (which degenerates on one host) are all correct."""
    res = harness.run(algorithms_rank, world_size, timeout=240, args=(f"algo{world_size}", None))
    harness.assert_no_failures(res)


@pytest.mark.parametrize("hosts", [["hA", "hA", "hB", "hB"], ["hA", "hB", "hA"], ["hX", "hY", "hY", "hY"]],
                         ids=["2x2", "2+1-interleaved", "1+3"])
def test_allreduce_algorithms_emulated_hosts(hosts):
    """RUMOR_HOST_ID splits one machine into 'hosts': hierarchical allreduce then really runs a
    shared-memory reduce inside each host and a TCP allreduce between host leaders. The rank
    queries (local_rank, machine_rank, ...) follow the emulated hosts."""
    n = len(hosts)
    res = harness.run(algorithms_rank, n, timeout=240, env={"RUMOR_SHM": "1", "RUMOR_TIMEOUT": "15"},
                      rank_env=[{"RUMOR_HOST_ID": h} for h in hosts], args=(f"hosts{n}", hosts))
    harness.assert_no_failures(res)


def sites_rank(key: str, hosts, sites):
    import rumor
    import torch
    from rumor import timeline

    failures, count = algorithms_rank(key, hosts)
    chk = Checker()
    n, r = rumor.size(), rumor.rank()
    x = torch.full((100003,), float(r))
    rumor.allreduce_(x, rumor.ReduceOp.AVG, algorithm="hierarchical")
    chk.equal(x, torch.full_like(x, sum(range(n)) / n), f"[{key}] hierarchical AVG over sites")
    steps = [(rec["name"], rec["comm"]) for rec in timeline.flight_records()]
    steps = steps[max(i for i, s in enumerate(steps) if s == ("allreduce", "world")) + 1:]
    mine = sites[r]
    equal = len({sites.count(s) for s in sites}) == 1
    if equal:  # every member carries its own block across: reduce-scatter, cross allreduce, allgather
        want = [("reduce_scatter", "world/local"), ("allreduce", "world/cross"), ("allgather", "world/local")]
    else:  # one leader per site
        leader = sites.index(mine) == r
        alone = sites.count(mine) == 1  # a group of one records no op of its own
        want = [("reduce", "world/local")] + ([("allreduce", "world/leaders")] if leader else []) + [
            ("broadcast", "world/local")]
        if alone:
            want = [w for w in want if w[1] != "world/local"]
    chk.check(steps == want, f"[{key}] rank {r} of site {mine}: the hierarchical allreduce ran {steps}, expected {want}")
    return failures + chk.failures, count + chk.count


@pytest.mark.parametrize("sites", [["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a", "a", "a", "b"]],
                         ids=["2x2", "interleaved", "3+1"])
def test_allreduce_algorithms_over_sites(sites):
    """RUMOR_SITE groups hosts (one rank each here, so every link is TCP) joined by fast links:
    hierarchical allreduce then groups by site instead of host. Sites of equal size reduce-scatter
    inside the site, allreduce each block with the same member of the other sites, and allgather;
    otherwise one leader per site carries the whole buffer."""
    n = len(sites)
    hosts = [f"h{r}" for r in range(n)]
    res = harness.run(sites_rank, n, timeout=240, env={"RUMOR_TIMEOUT": "15"},
                      rank_env=[{"RUMOR_HOST_ID": h, "RUMOR_SITE": s} for h, s in zip(hosts, sites)],
                      args=(f"sites{''.join(sites)}", hosts, sites))
    harness.assert_no_failures(res)


def _site_on_some_ranks():
    import rumor

    try:
        rumor.init()
    except ValueError as e:
        return str(e)
    rumor.shutdown()
    return "init succeeded"


def test_a_site_on_some_ranks_only_is_refused_by_every_rank():
    res = harness.run(_site_on_some_ranks, 3, timeout=120, rank_env=[{"RUMOR_SITE": "a"}, {}, {"RUMOR_SITE": "b"}])
    for msg in res:
        assert "RUMOR_SITE is set on rank(s) [0, 2] but not on rank(s) [1]" in msg, msg


def _auto_sites_rank():
    import rumor
    import torch
    from rumor import _runtime

    try:
        rumor.init()
    except ValueError as e:
        return str(e)
    sites = list(_runtime.state().ctx.sites)
    x = torch.full((1000,), float(rumor.rank()))
    rumor.allreduce_(x, rumor.ReduceOp.SUM, algorithm="hierarchical")
    ok = bool(torch.equal(x, torch.full_like(x, float(sum(range(rumor.size()))))))
    rumor.shutdown()
    return sites, ok


def test_site_auto_over_loopback_finds_one_site():
    """RUMOR_SITE=auto on 4 'hosts' of one machine: the round trips measured are all under the
    2 ms floor, so the hosts make one site and no sites are set (hosts group ranks as before)."""
    res = harness.run(_auto_sites_rank, 4, timeout=120,
                      rank_env=[{"RUMOR_SITE": "auto", "RUMOR_HOST_ID": f"h{r}"} for r in range(4)])
    for r, got in enumerate(res):
        assert got == ([], True), f"rank {r}: {got}"


def test_site_auto_on_some_ranks_only_is_refused_by_every_rank():
    res = harness.run(_auto_sites_rank, 3, timeout=120,
                      rank_env=[{"RUMOR_SITE": "auto"}, {"RUMOR_SITE": "a"}, {"RUMOR_SITE": "auto"}])
    for msg in res:
        assert "RUMOR_SITE is auto on rank(s) [0, 2] but names a site on rank(s) [1]" in msg, msg


# ---- non-contiguous tensors ----------------------------------------------------------------------

def noncontiguous_rank(key: str):
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.uint8]:
        for rows, cols in [(5, 3), (64, 33), (300, 257)]:
            case = f"[{key}] {dname(dtype)} {cols}x{rows} transposed"
            # Each rank's input is the transpose of a (rows, cols) tensor: a non-contiguous view.
            bases = [gen(key, q, dtype, "SUM", (rows, cols)) for q in range(n)]
            ref = reference([b.t() for b in bases], "SUM")
            base = bases[r].clone()
            v = base.t()
            assert not v.is_contiguous()
            out = rumor.allreduce(v, rumor.ReduceOp.SUM)
            chk.equal(out, ref, f"allreduce {case}")
            chk.equal(base, bases[r], f"allreduce {case}: input was modified")
            ret = rumor.allreduce_(v, rumor.ReduceOp.SUM)
            chk.equal(v, ref, f"allreduce_ {case}")
            chk.equal(base, ref.t(), f"allreduce_ {case}: the base tensor was not written")
            chk.check(ret is v, f"allreduce_ {case}: did not return its argument")

            base = bases[r].clone()
            v = base.t()
            h = rumor.allreduce_nonblocking_(v, rumor.ReduceOp.MAX)
            ret = h.wait()
            chk.equal(v, reference([b.t() for b in bases], "MAX"), f"allreduce_nonblocking_ {case}")
            chk.check(ret is v, f"allreduce_nonblocking_ {case}: wait() did not return the argument")

            base = bases[r].clone()
            v = base[::2]  # strided rows
            out = rumor.broadcast(v, n - 1)
            chk.equal(out, bases[n - 1][::2], f"broadcast strided {case}")
            chk.equal(base, bases[r], f"broadcast {case}: input was modified")
            rumor.broadcast_(v, 0)
            chk.equal(v, bases[0][::2], f"broadcast_ strided {case}")
            chk.equal(base[1::2], bases[r][1::2], f"broadcast_ {case}: wrote outside the view")
            base = bases[r].clone()
            v = base.t()
            rumor.broadcast_nonblocking_(v, n - 1).wait()
            chk.equal(v, bases[n - 1].t(), f"broadcast_nonblocking_ transposed {case}")

            v = bases[r].t()
            out = rumor.reduce(v, 0, rumor.ReduceOp.SUM)
            chk.equal(out, ref if r == 0 else bases[r].t(), f"reduce {case}")
            out = rumor.reduce_scatter(v, rumor.ReduceOp.SUM)
            chk.equal(out, ref.tensor_split(n)[r], f"reduce_scatter {case}")
            out = rumor.allgather(v)
            chk.equal(out, torch.cat([b.t() for b in bases]), f"allgather {case}")
            if cols % n == 0 or n == 1:
                out = rumor.alltoall(v)
                k = cols // n
                chk.equal(out, torch.cat([b.t()[r * k:(r + 1) * k] for b in bases]), f"alltoall {case}")
            splits = [cols - (n - 1)] + [1] * (n - 1) if n > 1 else [cols]
            out = rumor.alltoall(v, splits)
            recv_from = [(b.t()[: splits[0]] if r == 0 else b.t()[splits[0] + r - 1: splits[0] + r]) for b in bases]
            chk.equal(out, torch.cat(recv_from), f"alltoall splits={splits} {case}")
            if n > 1:
                # send a transposed view, receive into a transposed view
                if r == 0:
                    rumor.send(bases[0].t(), 1)
                elif r == 1:
                    dst = torch.zeros(rows, cols, dtype=dtype)
                    ret = rumor.recv(dst.t(), 0)
                    chk.equal(dst, bases[0], f"send/recv transposed {case}")
                    chk.equal(ret, bases[0].t(), f"recv {case}: return value")
    _allreduce_forms(chk, n, r, key)
    return _finish(chk)


def _allreduce_forms(chk, n, r, key):
    """rumor.allreduce_'s and rumor.allreduce's usual call (a plain contiguous CPU tensor, a
    ReduceOp, the world or a Group) takes a lean path (rumor._host_collectives.allreduce_plain);
    every other form of the same reduction takes the general one. Each form gives the exact result."""
    import rumor
    import torch

    inputs = [gen(key + "forms", q, torch.float32, "SUM", 1000) for q in range(n)]
    ref = reference(inputs, "SUM")
    everyone = rumor.new_group(list(range(n)))
    forms = {
        "plain": lambda x: rumor.allreduce_(x, rumor.ReduceOp.SUM),
        "op as an int": lambda x: rumor.allreduce_(x, 0),
        "group": lambda x: rumor.allreduce_(x, rumor.ReduceOp.SUM, group=everyone),
        "algorithm auto": lambda x: rumor.allreduce_(x, rumor.ReduceOp.SUM, algorithm="auto"),
        "parameter": lambda x: rumor.allreduce_(torch.nn.Parameter(x, requires_grad=False), rumor.ReduceOp.SUM),
        "0-d view": lambda x: [rumor.allreduce_(x[i], rumor.ReduceOp.SUM) for i in range(3)],
    }
    for name, call in forms.items():
        x = inputs[r].clone()
        ret = call(x)
        want = ref if name != "0-d view" else torch.cat([ref[:3], inputs[r][3:]])
        chk.equal(x, want, f"[{key}] allreduce_ ({name})")
        if name == "plain":
            chk.check(ret is x, f"[{key}] allreduce_ ({name}): did not return its argument")
    for name, call in {"plain": lambda x: rumor.allreduce(x, rumor.ReduceOp.SUM),
                       "op as an int": lambda x: rumor.allreduce(x, 0),
                       "group": lambda x: rumor.allreduce(x, rumor.ReduceOp.SUM, group=everyone)}.items():
        x = inputs[r].clone()
        out = call(x)
        chk.equal(out, ref, f"[{key}] allreduce ({name})")
        chk.equal(x, inputs[r], f"[{key}] allreduce ({name}): the input was modified")
    x = inputs[r].to(torch.complex64)  # no reduction for it: the general path's error
    try:
        rumor.allreduce_(x, rumor.ReduceOp.SUM)
        chk.check(False, f"[{key}] allreduce_ of complex64 did not raise")
    except TypeError as e:
        chk.check("unsupported dtype" in str(e), f"[{key}] allreduce_ of complex64: {e}")


@pytest.mark.parametrize("world_size,env", [(1, {}), (2, {}), (3, {"RUMOR_SHM": "0"})], ids=["1", "2", "3-tcp"])
def test_noncontiguous(world_size, env):
    res = harness.run(noncontiguous_rank, world_size, timeout=120, env=env, args=(f"nc{world_size}",))
    harness.assert_no_failures(res)


# ---- point to point and barrier ------------------------------------------------------------------

def p2p_rank(key: str, marker_dir: str):
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    sizes = [0, 1, 7, 1023, 65537, 300001, LARGE]
    # Every ordered pair, every size: the lower rank sends first, the higher receives first.
    for a in range(n):
        for b in range(a + 1, n):
            if r not in (a, b):
                continue
            peer = b if r == a else a
            for dtype in [torch.float32, torch.uint8, torch.bfloat16, torch.int64]:
                for size in sizes:
                    if size == LARGE and dtype != torch.float32:
                        continue
                    case = f"[{key}] {a}<->{b} {dname(dtype)} numel={size}"
                    mine = gen(key, r, dtype, "COPY", size)
                    theirs = gen(key, peer, dtype, "COPY", size)
                    buf = torch.full_like(theirs, 7)
                    if r == a:
                        rumor.send(mine, peer)
                        ret = rumor.recv(buf, peer)
                    else:
                        ret = rumor.recv(buf, peer)
                        rumor.send(mine, peer)
                    chk.equal(buf, theirs, f"send/recv {case}")
                    chk.check(ret is buf, f"recv {case}: did not return its argument")
    # Several messages queued to the same peer arrive in order.
    if n > 1:
        if r == 0:
            for i in range(5):
                rumor.send(torch.full((i + 1,), float(i)), n - 1)
        elif r == n - 1:
            for i in range(5):
                got = rumor.recv(torch.empty(i + 1), 0)
                chk.equal(got, torch.full((i + 1,), float(i)), f"[{key}] message {i} out of order")
    # Point-to-point traffic interleaved with collectives.
    x = torch.arange(10, dtype=torch.float32) + r
    chk.equal(rumor.allreduce(x, rumor.ReduceOp.SUM), torch.arange(10.0) * n + sum(range(n)),
              f"[{key}] allreduce after send/recv")
    # barrier: nobody leaves it before everybody entered it (each rank drops a marker file
    # before entering; after leaving, all markers must exist).
    for round_ in range(3):
        with open(os.path.join(marker_dir, f"r{round_}-{r}"), "w"):
            pass
        rumor.barrier()
        missing = [q for q in range(n) if not os.path.exists(os.path.join(marker_dir, f"r{round_}-{q}"))]
        chk.check(not missing, f"[{key}] barrier round {round_}: left it before ranks {missing} entered")
    return _finish(chk)


@pytest.mark.parametrize("world_size,env", [(2, {}), (3, {}), (4, {}), (3, {**TCP, "RUMOR_SOCKET_STREAMS": "4"})],
                         ids=["2", "3", "4", "3-tcp-4streams"])
def test_send_recv_barrier(world_size, env):
    with tempfile.TemporaryDirectory() as d:
        res = harness.run(p2p_rank, world_size, timeout=180, env=env, args=(f"p2p{world_size}", d))
    harness.assert_no_failures(res)


# ---- sub-groups ----------------------------------------------------------------------------------

def groups_rank(key: str):
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    ga_ranks = [1, 3] if n == 4 else [2, 0]
    gb_ranks = [2, 0, 1]
    ga = rumor.new_group(ga_ranks)
    gb = rumor.new_group(gb_ranks)
    for g, ranks in [(ga, ga_ranks), (gb, gb_ranks)]:
        chk.check(g.ranks == ranks, f"group ranks {g.ranks} != {ranks}")
        chk.check(g.size() == len(ranks), f"group size {g.size()}")
        want = ranks.index(r) if r in ranks else -1
        chk.check(g.rank() == want, f"{g!r}.rank() = {g.rank()} on rank {r}, expected {want}")
        chk.check((r in g) == (r in ranks), f"{g!r}: membership of {r}")

    def group_round(g, ranks, it):
        """Every collective on group g; ranks are global, group order = list order."""
        m = len(ranks)
        gi = ranks.index(r)
        tag = f"[{key}] group {ranks} round {it}"
        for dtype, op in [(torch.float32, "SUM"), (torch.int64, "MAX"), (torch.bfloat16, "AVG"), (torch.int32, "AVG"),
                          (torch.uint8, "PROD"), (torch.float64, "MIN")]:
            for size in [1, 7, 1023, 20000]:
                inputs = {q: gen(f"{key}{it}{ranks}", q, dtype, op, size) for q in ranks}
                ordered = [inputs[q] for q in ranks]
                ref = reference(ordered, op)
                case = f"{tag} {dname(dtype)} {op} numel={size}"
                check_reduced(chk, rumor.allreduce(inputs[r], _op(op), group=g), ref, op, f"allreduce {case}")
                check_reduced(chk, rumor.allreduce(inputs[r], _op(op), group=g, algorithm="ring"), ref, op,
                              f"allreduce ring {case}")
                check_reduced(chk, rumor.allreduce(inputs[r], _op(op), group=g, hierarchical=True), ref, op,
                              f"allreduce hierarchical {case}")
                for root in ranks:  # global ranks
                    out = rumor.reduce(inputs[r], root, _op(op), group=g)
                    if r == root:
                        check_reduced(chk, out, ref, op, f"reduce(root={root}) {case}")
                    else:
                        chk.equal(out, inputs[r], f"reduce(root={root}) {case} on a non-root")
                    chk.equal(rumor.broadcast(inputs[r], root, group=g), inputs[root], f"broadcast(root={root}) {case}")
                check_reduced(chk, rumor.reduce_scatter(inputs[r], _op(op), group=g), ref.tensor_split(m)[gi], op,
                              f"reduce_scatter {case}")
                rows = {q: (size % 5) + ranks.index(q) for q in ranks}
                parts = {q: gen(f"{key}{it}ag", q, dtype, "COPY", (rows[q], 2)) for q in ranks}
                chk.equal(rumor.allgather(parts[r], group=g), torch.cat([parts[q] for q in ranks]),
                          f"allgather (group order) {case}")
                src = {q: gen(f"{key}{it}a2a", q, dtype, "COPY", (m * 2, 3)) for q in ranks}
                exp = torch.cat([src[q][gi * 2:(gi + 1) * 2] for q in ranks])
                chk.equal(rumor.alltoall(src[r], group=g), exp, f"alltoall {case}")
        # send/recv inside the group with global dst/src: a ring in list order
        if m > 1:
            nxt, prv = ranks[(gi + 1) % m], ranks[(gi - 1) % m]
            mine = gen(f"{key}{it}p2p", r, torch.float32, "COPY", 1001)
            buf = torch.empty(1001)
            if gi % 2 == 0:
                rumor.send(mine, nxt, group=g)
                rumor.recv(buf, prv, group=g)
            else:
                rumor.recv(buf, prv, group=g)
                rumor.send(mine, nxt, group=g)
            chk.equal(buf, gen(f"{key}{it}p2p", prv, torch.float32, "COPY", 1001), f"{tag} send/recv ring")
        rumor.barrier(group=g)

    def nonmember(g, ranks):
        x = torch.ones(4)
        tag = f"[{key}] rank {r} outside group {ranks}"
        calls = {
            "allreduce": lambda: rumor.allreduce(x, group=g),
            "allreduce_": lambda: rumor.allreduce_(x.clone(), group=g),
            "allreduce_nonblocking": lambda: rumor.allreduce_nonblocking(x, group=g),
            "broadcast": lambda: rumor.broadcast(x, ranks[0], group=g),
            "broadcast_": lambda: rumor.broadcast_(x.clone(), ranks[0], group=g),
            "reduce": lambda: rumor.reduce(x, ranks[0], group=g),
            "allgather": lambda: rumor.allgather(x, group=g),
            "reduce_scatter": lambda: rumor.reduce_scatter(x, group=g),
            "alltoall": lambda: rumor.alltoall(torch.ones(len(ranks)), group=g),
            "barrier": lambda: rumor.barrier(group=g),
            "send": lambda: rumor.send(x, ranks[0], group=g),
            "recv": lambda: rumor.recv(x.clone(), ranks[0], group=g),
        }
        for name, call in calls.items():
            chk.raises(ValueError, call, f"{tag}: {name}", match="not a member")

    def world_round(it):
        x = gen(f"{key}w{it}", r, torch.float32, "SUM", 999)
        ref = reference([gen(f"{key}w{it}", q, torch.float32, "SUM", 999) for q in range(n)], "SUM")
        chk.equal(rumor.allreduce(x, rumor.ReduceOp.SUM), ref, f"[{key}] world allreduce round {it}")

    # Two groups used alternately, interleaved with world collectives.
    for it in range(3):
        for g, ranks in [(ga, ga_ranks), (gb, gb_ranks)]:
            if r in ranks:
                group_round(g, ranks, it)
            else:
                nonmember(g, ranks)
            world_round(it)
    # Root / src / dst that are not members of the group -> ValueError (checked before any traffic).
    if r in gb_ranks:
        outsider = next((q for q in range(n) if q not in gb_ranks), None)
        if outsider is not None:
            chk.raises(ValueError, lambda: rumor.broadcast(torch.ones(2), outsider, group=gb), "broadcast root outside the group")
            chk.raises(ValueError, lambda: rumor.reduce(torch.ones(2), outsider, group=gb), "reduce root outside the group")
            chk.raises(ValueError, lambda: rumor.send(torch.ones(2), outsider, group=gb), "send dst outside the group")
            chk.raises(ValueError, lambda: rumor.recv(torch.ones(2), outsider, group=gb), "recv src outside the group")
    # A group with every rank, in reverse order.
    rev = rumor.new_group(list(range(n))[::-1])
    parts = [torch.full((q + 1,), float(q)) for q in range(n)]
    chk.equal(rumor.allgather(parts[r], group=rev), torch.cat(parts[::-1]), f"[{key}] reversed world group allgather")
    # A group of one.
    solo = [rumor.new_group([q]) for q in range(n)]
    chk.equal(rumor.allreduce(torch.arange(5.0), rumor.ReduceOp.SUM, group=solo[r]), torch.arange(5.0),
              f"[{key}] group of one")
    return _finish(chk)


@pytest.mark.parametrize("world_size,env", [(3, {}), (4, {}), (4, {"RUMOR_SHM": "0"})], ids=["3", "4", "4-tcp"])
def test_groups(world_size, env):
    res = harness.run(groups_rank, world_size, timeout=180, env=env, args=(f"grp{world_size}",))
    harness.assert_no_failures(res)


# ---- nonblocking ---------------------------------------------------------------------------------

def _wait_poll(h, seconds=60.0):
    import rumor

    end = time.monotonic() + seconds
    while not rumor.poll(h):
        if time.monotonic() > end:
            raise AssertionError(f"rumor.poll() still False after {seconds} s")
        time.sleep(0.001)
    return True


def nonblocking_rank(key: str):
    import rumor
    import torch

    rumor.init()
    n, r = rumor.size(), rumor.rank()
    chk = Checker()
    for size in [1, 7, 1023, 65537, 300001]:
        # Three allreduces in flight, waited in reverse order.
        ops = ["SUM", "MAX", "AVG"]
        inputs = {op: [gen(f"{key}{op}", q, torch.float32, op, size) for q in range(n)] for op in ops}
        hs = [rumor.allreduce_nonblocking(inputs[op][r], _op(op)) for op in ops]
        for op, h in reversed(list(zip(ops, hs))):
            check_reduced(chk, h.wait(), reference(inputs[op], op), op, f"[{key}] nonblocking {op} numel={size}")
        # wait() twice returns the same result; synchronize() returns it too.
        h = rumor.allreduce_nonblocking(inputs["SUM"][r], rumor.ReduceOp.SUM)
        _wait_poll(h)
        chk.check(rumor.poll(h), "poll() went back to False")
        res = rumor.synchronize(h)
        chk.equal(res, reference(inputs["SUM"], "SUM"), f"[{key}] synchronize numel={size}")
        chk.check(h.wait() is res, "a second wait() returned another tensor")
        # In place, several tensors in flight.
        bufs = [inputs[op][r].clone() for op in ops]
        hs = [rumor.allreduce_nonblocking_(b, _op(op)) for b, op in zip(bufs, ops)]
        for b, op, h in zip(bufs, ops, hs):
            chk.check(h.wait() is b, "allreduce_nonblocking_ wait() did not return the argument")
            check_reduced(chk, b, reference(inputs[op], op), op, f"[{key}] nonblocking_ {op} numel={size}")
    # One of each nonblocking collective in flight at once, then waited out of order.
    x = gen(key + "mix", r, torch.int64, "SUM", 5000)
    xs = [gen(key + "mix", q, torch.int64, "SUM", 5000) for q in range(n)]
    bbuf = xs[r].clone()
    handles = {
        "allreduce": rumor.allreduce_nonblocking(x, rumor.ReduceOp.SUM),
        "broadcast": rumor.broadcast_nonblocking(x, n - 1),
        "broadcast_": rumor.broadcast_nonblocking_(bbuf, 0),
        "reduce": rumor.reduce_nonblocking(x, n - 1, rumor.ReduceOp.MAX),
        "allgather": rumor.allgather_nonblocking(x),
        "reduce_scatter": rumor.reduce_scatter_nonblocking(x, rumor.ReduceOp.MIN),
        "alltoall": rumor.alltoall_nonblocking(x[: (5000 // n) * n]),
    }
    k = 5000 // n
    expected = {
        "allreduce": reference(xs, "SUM"),
        "broadcast": xs[n - 1],
        "broadcast_": xs[0],
        "reduce": reference(xs, "MAX") if r == n - 1 else xs[r],
        "allgather": torch.cat(xs),
        "reduce_scatter": reference(xs, "MIN").tensor_split(n)[r],
        "alltoall": torch.cat([xs[q][r * k:(r + 1) * k] for q in range(n)]),
    }
    for name in ["alltoall", "reduce", "allgather", "broadcast_", "allreduce", "reduce_scatter", "broadcast"]:
        h = handles[name]
        chk.equal(h.wait(), expected[name], f"[{key}] {name}_nonblocking among others in flight")
    chk.equal(bbuf, xs[0], f"[{key}] broadcast_nonblocking_ did not write in place")
    chk.equal(x, xs[r], f"[{key}] nonblocking ops modified their input")
    # out=: allgather and reduce_scatter write into a given tensor and return it.
    rows = [q + 1 for q in range(n)]
    parts = [gen(key + "out", q, torch.int32, "COPY", (rows[q], 3)) for q in range(n)]
    buf = torch.empty(sum(rows), 3, dtype=torch.int32)
    ret = rumor.allgather(parts[r], out=buf)
    chk.check(ret is buf, f"[{key}] allgather(out=) did not return out")
    chk.equal(buf, torch.cat(parts), f"[{key}] allgather(out=)")
    buf2 = torch.empty(sum(rows), 3, dtype=torch.int32)
    h = rumor.allgather_nonblocking(parts[r], out=buf2)
    chk.check(h.wait() is buf2, f"[{key}] allgather_nonblocking(out=) did not return out")
    chk.equal(buf2, torch.cat(parts), f"[{key}] allgather_nonblocking(out=)")
    xs7 = [gen(key + "rso", q, torch.float32, "SUM", (7, 2)) for q in range(n)]
    blk = reference(xs7, "SUM").tensor_split(n)[r]
    o = torch.empty_like(blk)
    chk.check(rumor.reduce_scatter(xs7[r], rumor.ReduceOp.SUM, out=o) is o, f"[{key}] reduce_scatter(out=) return")
    chk.equal(o, blk, f"[{key}] reduce_scatter(out=)")
    o2 = torch.empty_like(blk)
    chk.check(rumor.reduce_scatter_nonblocking(xs7[r], rumor.ReduceOp.SUM, out=o2).wait() is o2,
              f"[{key}] reduce_scatter_nonblocking(out=) return")
    chk.equal(o2, blk, f"[{key}] reduce_scatter_nonblocking(out=)")
    chk.equal(xs7[r], gen(key + "rso", r, torch.float32, "SUM", (7, 2)), f"[{key}] reduce_scatter modified its input")
    # A blocking collective issued while nonblocking ones are queued runs after them.
    h1 = rumor.allreduce_nonblocking(torch.full((300001,), float(r)), rumor.ReduceOp.SUM)
    out = rumor.allreduce(torch.full((3,), 1.0), rumor.ReduceOp.SUM)
    chk.equal(out, torch.full((3,), float(n)), f"[{key}] blocking op behind a nonblocking one")
    chk.equal(h1.wait(), torch.full((300001,), float(sum(range(n)))), f"[{key}] nonblocking op before a blocking one")
    return _finish(chk)


@pytest.mark.parametrize("world_size,env", [(1, {}), (2, {}), (4, {}), (3, {"RUMOR_SHM": "0"})], ids=["1", "2", "4", "3-tcp"])
def test_nonblocking(world_size, env):
    res = harness.run(nonblocking_rank, world_size, timeout=180, env=env, args=(f"nb{world_size}",))
    harness.assert_no_failures(res)
