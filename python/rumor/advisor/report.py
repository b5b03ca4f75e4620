"""The advisor's table: what was measured and each algorithm's predicted step, as text."""
from __future__ import annotations

from typing import Dict, List

from .model import SPLIT_GAP_S

__all__ = ["format_table"]


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def format_table(m: Dict, rows: List[Dict], tref: Dict) -> str:
    """The advisor's printed report: what was measured, then one line per algorithm.

    Args:
        m: the measured figures (Advice.measured).
        rows: the ranked rows (rank_rows(predict(...)), each with speedup_over_torch).
        tref: the torch DDP row (predict_torch(...)).

    Returns:
        The table as text, lines separated by newlines.
    """
    lines = [f"rumor advisor: {m['ranks']} ranks on {m['hosts']} host(s), up to {m['local_size']} per host",
             "measured (slowest rank):",
             f"  compute: forward {m['forward_s'] * 1e3:.1f} ms, backward {m['backward_s'] * 1e3:.1f} ms, "
             f"optimizer {m['optimizer_s'] * 1e3:.1f} ms; last gradient ready on every rank {m['last_ready_s'] * 1e3:.1f} ms "
             f"into backward; each step's slowest rank {m.get('straggler_s', 0.0) * 1e3:.1f} ms over that, "
             f"{m.get('comm_work_steal', 0.0):.2f} of a comm thread's CPU work taken from compute"
             + (f"; the ranks' mean step {m['free_step_s'] * 1e3:.1f} ms (what steps that synchronize nothing take)"
                if "free_step_s" in m else ""),
             f"  gradients: {m['grad_elements'] / 1e6:.2f} M elements, {m['grad_bytes'] / 1e6:.1f} MB "
             f"({', '.join(m['dtypes'])}) in {m['params']} tensors; {len(m['buckets'])} buckets (25 MB, split where "
             f"gradients come > {SPLIT_GAP_S * 1e3:.0f} ms apart), torch DDP {len(m.get('torch_buckets', ()))}",
             f"  buffers broadcast before each forward: {m.get('buffer_bytes', 0) / 1e3:.1f} kB"]
    for key, what in (("intra", "inside a host (ring allreduce over shared memory)"),
                      ("inter", "between hosts (ring allreduce among one rank per host)")):
        link = m[key]
        if link is None:
            lines.append(f"  {what}: not measured (" + ("one rank per host)" if key == "intra" else "one host)"))
        else:
            size = f", fitted up to {link['samples'][-1][0] / 1e6:.1f} MB" if link.get("samples") else ""
            lines.append(f"  {what}: {_rate(link['bandwidth_Bps'])}, {link['latency_s'] * 1e6:.0f} us per hop "
                         f"({link['ranks']} ranks{size})")
            if key == "intra" and m.get("intra_ends") is not None:
                e, b = m["intra_ends"], m.get("intra_broadcast") or {}
                lines.append(f"  the hierarchical allreduce's legs inside a host (reduce to the leader + its broadcast): "
                             f"{_rate(e['bandwidth_Bps'])}, {e['latency_s'] * 1e6:.0f} us; the broadcast alone "
                             f"{_rate(b.get('bandwidth_Bps', 0.0))}")
            if key == "inter" and m.get("pair") is not None:
                p = m["pair"]
                lines.append(f"  a swap with one peer between hosts (both ways at once): {_rate(p['bandwidth_Bps'])}, "
                             f"{p['latency_s'] * 1e6:.0f} us; the network beside compute runs at "
                             f"{m.get('comm_rate_beside_compute', 1.0):.2f} of its rate alone")
            if key == "inter" and "net_cpu_s_per_byte" in m:
                lines.append(f"  network CPU: {m['net_cpu_s_per_byte'] * 1e9:.2f} ms per MB sent; compute uses "
                             f"{m['compute_cpu_share']:.2f} CPU per second, so each MB sent beside it costs "
                             f"{m['net_cost_s_per_byte'] * 1e9:.2f} ms of compute")
    if m.get("loopback") is not None:
        lo = m["loopback"]
        lines.append(f"  one host, beside compute: a weight mix (copy + ring allreduce) "
                     f"{m['mix_s_per_byte'] * 1e9:.2f} ms per MB alone, at {m['mix_rate_beside_compute']:.2f} of that "
                     f"beside compute, lengthening compute {m['mix_stretch']:.2f} s per s of it; TCP over loopback "
                     f"(torch DDP's gloo) {_rate(lo['bandwidth_Bps'])}, {lo['latency_s'] * 1e6:.0f} us, at "
                     f"{m['loopback_rate_beside_compute']:.2f} beside compute, lengthening compute "
                     f"{m['loopback_stretch']:.2f} s per s")
    if "arena_round_s_per_element" in m:
        lines.append(f"  one host: AsyncModelAverage's round in the shared arena "
                     f"{m['arena_round_s_per_element'] / 4 * 1e9:.2f} ms per MB of weights alone, at "
                     f"{m['arena_rate_beside_compute']:.2f} of that beside compute, lengthening compute "
                     f"{m['arena_stretch']:.2f} s per s of it")
    lines.append("  codecs (ns per element, encode/decode; wire bytes per element): " + ", ".join(
        f"{k} {c['encode_s_per_element'] * 1e9:.2f}/{c['decode_s_per_element'] * 1e9:.2f}; "
        f"{c['wire_bytes_per_element']:.3f}" for k, c in m["codecs"].items()))
    if "elementwise_s_per_element" in m:
        lines.append(f"  weight arithmetic {m['elementwise_s_per_element'] * 1e9:.2f} ns per element and pass; "
                     f"PowerSGD kernels (rank {m['powersgd_rank']}) {m['powersgd_s_per_element'] * 1e9:.2f} ns "
                     "per matrix element")
    lines.append(f"predicted step of torch DDP (flat fp32 ring, gloo): {tref['predicted_step_s'] * 1e3:.1f} ms")
    head = f"{'#':>2} {'algorithm':<30} {'step ms':>9} {'x torch':>8} {'exposed ms':>10}  convergence"
    lines += [head, "-" * (len(head) + 40)]
    for i, r in enumerate(rows):
        lines.append(f"{i + 1:>2} {r['algorithm']:<30} {r['predicted_step_s'] * 1e3:>9.1f} "
                     f"{r['speedup_over_torch']:>7.2f}x {r['exposed_comm_s'] * 1e3:>10.1f}  {r['caveat']}")
    best = rows[0]
    lines.append(f"suggestion: rumor.DistributedDataParallel(model, optimizer, {best['kwargs']})")
    return "\n".join(lines)
