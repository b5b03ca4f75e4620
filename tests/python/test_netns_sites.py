"""RUMOR_SITE=auto: the sites found from the hosts' round trips (python/rumor/_rendezvous.py,
find_sites and sites_from_rtts).

- The rule alone, on matrices: two sites of two hosts at 5 ms inside and 80 ms across; equal
  links; loopback-short links (the floor); a chain of near hosts; a missing measurement.
- Four emulated hosts (rumor.testing.netns, one rank each): 5 ms round trips inside two pairs and
  80 ms across give two sites of two hosts, every rank with the same names, and a hierarchical
  allreduce over them is exact; 5 ms everywhere gives no sites (hosts group ranks as without
  RUMOR_SITE). Skipped, with the reason, where network namespaces cannot be built. Every run has
  a deadline; on it every rank is killed and the test fails with each rank's output.
"""
from __future__ import annotations

import json
import os
import sys

from harness import run_on_hosts

from rumor._rendezvous import sites_from_rtts

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
PORT = 29500          # inside host 0's fresh namespace nothing else listens
RUN_DEADLINE_S = 90   # a whole run (a few seconds when healthy)
COUNT = 1 << 20       # float32 elements of the allreduce run over the sites found

_BOOT = "import sys; sys.path.insert(0, {here!r}); import test_netns_sites as t; t._rank_main()"


# ---- the rule ------------------------------------------------------------------------------------

def _matrix(h, rtt):
    return [[0.0 if a == b else rtt(a, b) for b in range(h)] for a in range(h)]


def test_two_sites_of_two_hosts():
    m = _matrix(4, lambda a, b: 0.005 if a // 2 == b // 2 else 0.080)
    assert sites_from_rtts(m) == [0, 0, 1, 1]
    # Sites are numbered by their first host, whatever the host order.
    m = _matrix(4, lambda a, b: 0.005 if a % 2 == b % 2 else 0.080)
    assert sites_from_rtts(m) == [0, 1, 0, 1]


def test_equal_or_short_links_make_one_site():
    assert sites_from_rtts(_matrix(4, lambda a, b: 0.040)) == [0, 0, 0, 0]
    # Below the floor (2 ms) every pair joins, even 10x apart: racks of one room are one site.
    assert sites_from_rtts(_matrix(3, lambda a, b: 0.0001 if a + b == 1 else 0.001)) == [0, 0, 0]


def test_chains_join_and_a_missing_figure_does_not_split():
    # 0-1 and 1-2 near, 0-2 far: single linkage joins all three through host 1.
    m = _matrix(4, lambda a, b: {(0, 1): 0.005, (1, 2): 0.006, (0, 2): 0.030}.get((min(a, b), max(a, b)), 0.09))
    assert sites_from_rtts(m) == [0, 0, 0, 1]
    m = _matrix(3, lambda a, b: 0.0 if {a, b} == {0, 2} else 0.080)
    m[0][1] = m[1][0] = 0.005
    assert sites_from_rtts(m) == [0, 0, 0]


# ---- inside a rank -------------------------------------------------------------------------------

def _rank_main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(RUN_DEADLINE_S - 5, exit=True)
    import logging

    import torch

    import rumor
    from rumor import _runtime

    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO)  # rank 0 logs the round trips and the sites found
    rumor.init(timeout=30)
    sites = list(_runtime.state().ctx.sites)
    i = torch.arange(COUNT, dtype=torch.int64)
    x = (((i * 7 + rank * 13) % 61) - 30).to(torch.float32)
    want = sum((((i * 7 + r * 13) % 61) - 30) for r in range(WORLD)).to(torch.float32)
    y = rumor.allreduce(x, op=rumor.ReduceOp.SUM, hierarchical=True)
    print("RESULT " + json.dumps({"rank": rank, "sites": sites, "exact": bool(torch.equal(y, want))}), flush=True)
    sys.stdout.flush()
    os._exit(0)


# ---- emulated hosts ------------------------------------------------------------------------------

def _run(tmp_path, name: str, delay):
    return run_on_hosts(tmp_path, name, _BOOT.format(here=HERE), WORLD, PORT, RUN_DEADLINE_S,
                        env={"RUMOR_SITE": "auto"}, delay=delay)


def test_auto_finds_two_sites_of_two_hosts(tmp_path):
    # One-way delays: 2.5 ms inside hosts {0, 1} and {2, 3}, 40 ms across.
    res, dump = _run(tmp_path, "two-sites", lambda i, j: 0.0025 if i // 2 == j // 2 else 0.040)
    for r in range(WORLD):
        assert res[r]["sites"] == ["auto-0", "auto-0", "auto-1", "auto-1"], f"rank {r}: {res[r]}\n{dump}"
        assert res[r]["exact"], f"rank {r}: the allreduce over the sites found is not exact\n{dump}"


def test_auto_with_equal_links_sets_no_sites(tmp_path):
    res, dump = _run(tmp_path, "one-site", 0.0025)
    for r in range(WORLD):
        assert res[r]["sites"] == [], f"rank {r}: {res[r]}\n{dump}"
        assert res[r]["exact"], f"rank {r}\n{dump}"
