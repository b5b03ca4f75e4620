"""What one bucket's communication does when DistributedDataParallel keeps the gradients on the
GPU and NCCL moves them (docs/gpu.md, "DistributedDataParallel on CUDA").

A bucket op is written once against a Transport of the bucket's group, whose calls queue work
on the current stream:

- NcclTransport: the group's NCCL communicator (rumor._C.NcclCommunicator), on the engine's
  communication stream;
- HostTransport: rumor's CPU collectives on CPU tensors, blocking. The engine's emulation
  (rumor.engine.device.EMULATE) runs the very same op code through it, so the tests check the
  ops' arithmetic and message pattern bit for bit against the C++ ops on any machine.

The ops:

- AllreduceOp: one allreduce (NCCL chooses its own ring/tree, so GradientAllReduce's
  hierarchical and small_allreduce_kb settings do not apply).
- CompressedOp: the compressed reduce-scatter + allgather of ops::CompressedAllreduce::flat
  (csrc/ops/compressed_allreduce.cpp) with the CUDA codecs: the same blocks, seeds, float32
  accumulation in rank order and re-encoding by the block's owner, so the result is the one the
  CPU op computes (QSGD's draws differ only where the CPU op pipelines a block of more than
  256 Ki elements: it then seeds per piece).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .. import _C, _runtime
from .._tensor import address, dtype_code

def _one_dtype(sends, recvs) -> int:
    """The dtype code of an exchange's tensors, which must share one (counts are elements)."""
    dtypes = {t.dtype for _, t in sends} | {t.dtype for _, t in recvs}
    if len(dtypes) > 1:
        raise TypeError(f"exchange: tensors of one dtype expected, got {sorted(map(str, dtypes))}")
    return dtype_code(dtypes.pop() if dtypes else torch.uint8, "exchange")


def _prefix(xs: Sequence[int]) -> List[int]:
    out, s = [], 0
    for x in xs:
        out.append(s)
        s += x
    return out


class _Blocks:
    """The split of a bucket into one block per rank for a compressed reduce-scatter +
    allgather (ops::Blocks of csrc/ops/compressed_allreduce.cpp): block j belongs to rank j, and
    ``wire`` holds one encoding per block, back to back."""

    def __init__(self, count: int, n: int, r: int, kind: int, chunk: int, codec, device):
        self.n, self.r = n, r
        self.counts = list(_C.compressed_blocks(count, n, kind, chunk))
        self.off = _prefix(self.counts)
        self.enc = [codec.encoded_bytes(c) for c in self.counts]
        self.eoff = _prefix(self.enc)
        self.wire = torch.empty(sum(self.enc), dtype=torch.uint8, device=device)
        self.peers = [q for q in range(n) if q != r]

    def block(self, t: torch.Tensor, j: int) -> torch.Tensor:
        return t[self.off[j]:self.off[j] + self.counts[j]]

    def encoding(self, j: int) -> torch.Tensor:
        return self.wire[self.eoff[j]:self.eoff[j] + self.enc[j]]

    def to_owners(self, tp, what: str) -> dict:
        """Sends encoding j to rank j; returns {q: rank q's encoding of our block} (ours too,
        from the wire), once they are here (settled: decoding reads headers on the host)."""
        r, e = self.r, self.enc[self.r]
        recv = torch.empty(len(self.peers) * e, dtype=torch.uint8, device=self.wire.device)
        got = {q: recv[i * e:(i + 1) * e] for i, q in enumerate(self.peers)}
        tp.exchange([(j, self.encoding(j)) for j in self.peers if self.counts[j]],
                    [(q, got[q]) for q in self.peers] if self.counts[r] else [])
        tp.settle(what)
        got[r] = self.encoding(r)
        return got

    def from_owners(self, tp, what: str) -> List[torch.Tensor]:
        """Every rank's encoding of its own block (wire slot r here), to everyone: NCCL's
        allgather moves equal sizes, so each travels in a slot of the largest one's size."""
        n, r, width = self.n, self.r, max(self.enc)
        gathered = torch.empty(n * width, dtype=torch.uint8, device=self.wire.device)
        mine = gathered[r * width:(r + 1) * width]
        mine[:self.enc[r]].copy_(self.encoding(r))
        tp.allgather(mine, gathered)
        tp.settle(what)
        return [gathered[j * width:j * width + self.enc[j]] for j in range(n)]


def _divisor(n: int, device) -> torch.Tensor:
    # A tensor divisor, not a Python number: torch turns division by a scalar into
    # multiplication by its reciprocal on the GPU, which would round differently from the C++
    # ops' division for world sizes that are not powers of two.
    return torch.full((1,), float(n), dtype=torch.float32, device=device)


class NcclTransport:
    """The bucket ops' calls on a group's NCCL communicator, queued on the current stream of the
    group's device. settle() is the only host wait: an event polled with rumor's deadline, which
    aborts the communicator (and so ends its kernels) instead of hanging."""

    def __init__(self, gpu):
        self.gpu = gpu
        self.comm = gpu.comm
        self.rank, self.size = self.comm.rank, self.comm.size

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.gpu.torch_device).cuda_stream

    def allreduce(self, t: torch.Tensor, op: int) -> None:
        self.comm.allreduce(address(t), address(t), t.numel(), dtype_code(t.dtype, "allreduce"), int(op),
                            self._stream())

    def exchange(self, sends: List[Tuple[int, torch.Tensor]], recvs: List[Tuple[int, torch.Tensor]]) -> None:
        code = _one_dtype(sends, recvs)
        self.comm.exchange([(address(t), t.numel(), peer) for peer, t in sends],
                           [(address(t), t.numel(), peer) for peer, t in recvs], code, self._stream())

    def allgather(self, mine: torch.Tensor, out: torch.Tensor) -> None:
        self.comm.allgather(address(mine), address(out), mine.numel(), dtype_code(mine.dtype, "allgather"),
                            self._stream())

    def abort(self) -> None:
        self.comm.abort()

    def settle(self, what: str) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.gpu.torch_device))
        self.comm.wait(ev.query, _runtime.state().timeout, what)


class HostTransport:
    """The same calls through rumor's C++ communicator on CPU tensors; each returns when done."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    def allreduce(self, t: torch.Tensor, op: int) -> None:
        self.comm.allreduce(address(t), t.numel(), dtype_code(t.dtype, "allreduce"), int(op), 0, False)

    def exchange(self, sends: List[Tuple[int, torch.Tensor]], recvs: List[Tuple[int, torch.Tensor]]) -> None:
        # One alltoall: its buffers are contiguous in rank order, so the parts are gathered and
        # scattered around it (a copy NCCL's grouped send/recv does not need).
        n = self.size
        send_counts, recv_counts = [0] * n, [0] * n
        for peer, t in sends:
            send_counts[peer] += t.numel()
        for peer, t in recvs:
            recv_counts[peer] += t.numel()
        code = _one_dtype(sends, recvs)
        dtype = (sends or recvs)[0][1].dtype if sends or recvs else torch.uint8
        ordered = [t for _, t in sorted(sends, key=lambda pt: pt[0])]
        src = torch.cat(ordered) if ordered else torch.empty(0, dtype=dtype)
        dst = torch.empty(sum(recv_counts), dtype=dtype)
        self.comm.alltoall(address(src), send_counts, address(dst), recv_counts, code, False)
        at = _prefix(recv_counts)
        for peer, t in sorted(recvs, key=lambda pt: pt[0]):
            t.copy_(dst[at[peer]:at[peer] + t.numel()])
            at[peer] += t.numel()

    def allgather(self, mine: torch.Tensor, out: torch.Tensor) -> None:
        n = self.size
        out[self.rank * mine.numel():(self.rank + 1) * mine.numel()].copy_(mine)
        self.comm.allgather(address(out), [mine.numel()] * n, dtype_code(mine.dtype, "allgather"), False)

    def settle(self, what: str) -> None:
        pass

    def abort(self) -> None:
        pass  # rumor's communicator aborted itself on the error that got here


class AllreduceOp:
    """GradientAllReduce's bucket: one allreduce, AVG or SUM."""

    def __init__(self, op: int):
        self.op = int(op)

    def run(self, flat: torch.Tensor, tp) -> None:
        if tp.size > 1 and flat.numel():
            tp.allreduce(flat, self.op)

    def launches_only(self, tp) -> bool:
        # Whether run() only queues work on the stream and never waits on the host; the engine
        # then launches the bucket from the autograd thread instead of its worker.
        return True

    def __repr__(self) -> str:
        return f"AllreduceOp({self.op})"


class CompressedOp:
    """ByteGrad / QSGD / LowPrecision's bucket without hierarchy (see the module docstring).

    Rank r encodes its contribution to every other rank's block (seeded by bucket, call, rank
    and block), sends it to the block's owner, adds the peers' decoded contributions in rank
    order to its own block in float32, divides for the average, encodes the result once and
    sends that to everyone; every rank decodes every block from those same bytes."""

    def __init__(self, kind: int, chunk: int, levels: int, average: bool, seed: int):
        from ..compression import Codec

        self.kind, self.chunk, self.levels = int(kind), int(chunk), int(levels)
        self.average = bool(average)
        self.seed = int(seed)
        self.codec = Codec(_C.CodecKind(self.kind), self.chunk or None, self.levels)
        self.calls = 0

    def launches_only(self, tp) -> bool:
        return tp.size == 1  # else the decodes read the encodings' headers on the host

    def run(self, flat: torch.Tensor, tp) -> None:
        step = self.calls
        self.calls += 1
        n, r = tp.size, tp.rank
        if n == 1 or flat.numel() == 0:
            return
        codec = self.codec
        bl = _Blocks(flat.numel(), n, r, self.kind, self.chunk, codec, flat.device)
        for j in bl.peers:
            if bl.counts[j]:
                codec.encode(bl.block(flat, j), seed=_C.compressed_seed(self.seed, step, r, j, 0), out=bl.encoding(j))
        got = bl.to_owners(tp, "rumor.DistributedDataParallel: compressed allreduce (reduce-scatter)")
        if bl.counts[r]:
            # Our own contribution at full precision, the peers' decoded, in rank order.
            acc = bl.block(flat, r).to(torch.float32, copy=True)
            for q in bl.peers:
                codec.decode(got[q], bl.counts[r], out=acc, accumulate=True)
            if self.average:
                acc.div_(_divisor(n, flat.device))
            codec.encode(acc, seed=_C.compressed_seed(self.seed, step, r, r, 1), out=bl.encoding(r))
        encs = bl.from_owners(tp, "rumor.DistributedDataParallel: compressed allreduce (allgather)")
        for j in range(n):
            if bl.counts[j]:
                codec.decode(encs[j], bl.counts[j], out=bl.block(flat, j))

    def __repr__(self) -> str:
        return f"CompressedOp({self.codec.name}, average={self.average})"


class LocalOp:
    """The bucket op of algorithms whose backward communicates nothing (they move weights
    instead): the wrapper then leaves each .grad where autograd put it."""

    def run(self, flat: torch.Tensor, tp) -> None:
        pass

    def launches_only(self, tp) -> bool:
        return True

    def __repr__(self) -> str:
        return "LocalOp()"


class WeightMix:
    """Decentralized's weight mix of flat device buffers, ins -> outs, with one plan
    (average_all, self weight, [(src, weight)], [dst]) in the ranks of the group. Runs as a
    DeviceEngine task on its communication stream.

    Direct (NCCL): the plain form on the device: an AVG allreduce when the plan averages over
    everyone (and for hierarchical=True on one host, which is an exact average whatever the
    plan), else one group of sends of x to the destinations and receives from the sources,
    then out = self_weight * x + sum_j w_j * x_j (x + sum x_j, divided once, when all weights are
    equal, as the C++ op does). Staged: each buffer goes to a page-locked twin, the C++
    WeightMixOp mixes those (the only form for hierarchical=True across hosts), and the result
    comes back on the stream."""

    def __init__(self, comm, hierarchical: bool, staged: bool, layer):
        self.comm, self.hierarchical, self.staged, self.layer = comm, bool(hierarchical), bool(staged), layer
        self._twins = {}  # id(device buffer) -> its page-locked twin
        self._host_ops = {}  # (id(in), id(out)) -> C++ WeightMixOp over the twins
        self._recv = {}  # (buffer numel, dtype, k) -> k-th receive buffer

    def _twin(self, t: torch.Tensor) -> torch.Tensor:
        tw = self._twins.get(id(t))
        if tw is None or tw.numel() != t.numel() or tw.dtype != t.dtype:
            tw = self._twins[id(t)] = self.layer.pinned_like(t)
        return tw

    def run(self, tp, ins: List[torch.Tensor], outs: List[torch.Tensor], plan, stream, timeout: float) -> None:
        average_all, self_w, srcs, dsts = plan
        if self.staged:
            self._staged(ins, outs, plan, stream, timeout)
            return
        for x, out in zip(ins, outs):
            if average_all or (self.hierarchical and self.comm.all_local):
                out.copy_(x)
                tp.allreduce(out, 1)  # ReduceOp.AVG
                continue
            bufs = []
            for k in range(len(srcs)):
                key = (x.numel(), x.dtype, k)
                b = self._recv.get(key)
                if b is None:
                    b = self._recv[key] = torch.empty_like(x)
                bufs.append(b)
            tp.exchange([(d, x) for d in dsts], [(s, b) for (s, _), b in zip(srcs, bufs)])
            if srcs and self_w > 0 and all(w == self_w for _, w in srcs):
                out.copy_(x)
                for b in bufs:
                    out.add_(b)
                k = round(1.0 / self_w)
                if 1.0 / k == self_w:  # BlueFog's 1/(d+1): one division rounds once
                    out.div_(torch.full((1,), float(k), dtype=out.dtype, device=out.device))
                else:
                    out.mul_(self_w)
            else:
                torch.mul(x, self_w, out=out)
                for (_, w), b in zip(srcs, bufs):
                    out.add_(b, alpha=w)

    def _staged(self, ins, outs, plan, stream, timeout: float) -> None:
        from .._tensor import address, dtype_code

        layer = self.layer
        tin = [self._twin(x) for x in ins]
        tout = [self._twin(o) for o in outs]
        with layer.on(stream):
            for x, t in zip(ins, tin):
                t.copy_(x, non_blocking=True)
            copied = layer.record(stream)
        layer.host_wait(copied, timeout, "rumor Decentralized: copying the weights to host memory")
        ops = []
        for t, o in zip(tin, tout):
            op = self._host_ops.get((id(t), id(o)))
            if op is None:
                op = self._host_ops[(id(t), id(o))] = _C.WeightMixOp(address(t), address(o), t.numel(),
                                                                   dtype_code(t.dtype, "Decentralized"),
                                                                   self.hierarchical)
            ops.append(op)
        average_all, self_w, srcs, dsts = plan
        _C.weight_mix(self.comm, ops, average_all, self_w, srcs, dsts, False)
        with layer.on(stream):
            for o, t in zip(outs, tout):
                o.copy_(t, non_blocking=True)


class OneBitMomentumOp:
    """1-bit Adam's bucket (ops::OneBitMomentumBucketOp) on the device. While not compressing:
    the warm-up's average of the gradients (an AllreduceOp). While compressing, from the
    bucket's gradients g: x = beta1 * m + (1 - beta1) * g * inv_denom + worker_error, each
    block compressed to signs and a per-chunk scale (SignScale) and sent to its owner, which
    averages the decoded contributions in rank order, adds its server error, compresses again
    and sends the result to everyone; both sides keep what their compression lost, and the
    averaged momentum lands in m. The same float32 operations in the same order as the C++ op,
    so the results are its bits. hierarchical=True on one host (the only hierarchical form with
    device ops) averages the locally updated momentum at full precision."""

    def __init__(self, momentum: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                 beta1: float, chunk: int, hierarchical: bool):
        from ..compression import Codec

        self.m, self.we, self.se = momentum, worker_error, server_error
        self.beta1 = torch.tensor(beta1, dtype=torch.float32).item()  # as the C++ op's float
        self.a = (torch.tensor(1.0, dtype=torch.float32) - torch.tensor(beta1, dtype=torch.float32)).item()
        self.chunk, self.hierarchical = int(chunk), bool(hierarchical)
        self.codec = Codec(_C.CodecKind.Sign, self.chunk or None)
        self.warmup = AllreduceOp(1)  # ReduceOp.AVG
        self.compressing = False
        self.inv_denom = None

    def set_preconditioner(self, inv_denom) -> None:
        self.inv_denom = inv_denom

    def _update(self, g: torch.Tensor) -> torch.Tensor:
        """b * m + (a * g) * inv, rounded op by op as the C++ loop does."""
        x = self.m * self.beta1
        ag = g * self.a
        if self.inv_denom is not None:
            ag.mul_(self.inv_denom)
        return x.add_(ag)

    def _lossy(self, x: torch.Tensor, err: torch.Tensor, out: torch.Tensor) -> None:
        """out <- encode(x); err <- x - decode(out)."""
        self.codec.encode(x, out=out)
        self.codec.decode(out, x.numel(), out=err)
        torch.sub(x, err, out=err)

    def launches_only(self, tp) -> bool:
        return not self.compressing  # the 1-bit exchange decodes on the host

    def run(self, flat: torch.Tensor, tp) -> None:
        if not self.compressing:
            self.warmup.run(flat, tp)
            return
        n, r = tp.size, tp.rank
        if n == 1 or self.hierarchical:
            self.m.copy_(self._update(flat))
            if n > 1:
                tp.allreduce(self.m, 1)
            return
        codec = self.codec
        x = self._update(flat).add_(self.we)
        bl = _Blocks(flat.numel(), n, r, int(_C.CodecKind.Sign), self.chunk, codec, flat.device)
        # Worker: every block of x (ours included) compressed; the worker error keeps the loss.
        for j in range(n):
            if bl.counts[j]:
                self._lossy(bl.block(x, j), bl.block(self.we, j), bl.encoding(j))
        got = bl.to_owners(tp, "rumor.DistributedDataParallel: 1-bit allreduce (to the owners)")
        if bl.counts[r]:
            # Server: the contributions decoded in rank order, averaged, plus the server error;
            # compressed once more, the server error keeping that loss.
            acc = torch.empty(bl.counts[r], dtype=torch.float32, device=flat.device)
            for q in range(n):
                codec.decode(got[q], bl.counts[r], out=acc, accumulate=q != 0)
            se = bl.block(self.se, r)
            acc.div_(_divisor(n, flat.device)).add_(se)
            self._lossy(acc, se, bl.encoding(r))
        encs = bl.from_owners(tp, "rumor.DistributedDataParallel: 1-bit allreduce (from the owners)")
        for j in range(n):
            if bl.counts[j]:
                codec.decode(encs[j], bl.counts[j], out=bl.block(self.m, j))

    def __repr__(self) -> str:
        return f"OneBitMomentumOp(compressing={self.compressing})"


class LowPrecisionRing:
    """LowPrecisionDecentralized's state and steps for one flat weight buffer x on the device
    (ops::LowPrecisionMixOp): the tracked copy xh and the replicas of the ring neighbours'.

    prepare() runs on the caller's stream right after optimizer.step(): x moves toward the
    replicas, the difference x - xh is compressed (MinMaxUInt8) into q and xh += decode(q); with
    hierarchical=True on one host it is an average of x instead (no ring). send() queues the
    exchange of q with both neighbours; receive() adds the neighbours' decoded q to their
    replicas. The same float operations in the same order as the C++ op."""

    def __init__(self, x: torch.Tensor, n: int, rank: int, hierarchical: bool, all_local: bool, chunk: int):
        from ..compression import Codec

        self.x = x
        self.average_only = hierarchical and all_local
        self.n, self.rank = n, rank
        self.ring = not self.average_only and n > 1
        self.codec = Codec(_C.CodecKind.MinMaxU8, int(chunk) or None)
        k = 1 if n == 2 else 2
        self.k = k
        one = torch.ones((), dtype=x.dtype)
        self.w = (one / (k + 1)).item()  # T(1) / T(k + 1) of the C++ op
        if self.ring:
            self.self_ = x.detach().clone()
            self.left = self.self_.clone()
            self.right = self.self_.clone() if k == 2 else None
            nbytes = self.codec.encoded_bytes(x.numel())
            self.q = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
            self.recv = torch.empty(nbytes * (2 if k == 2 else 1), dtype=torch.uint8, device=x.device)

    def prepare(self, tp) -> None:
        if self.average_only:
            if tp.size > 1 and self.x.numel():
                tp.allreduce(self.x, 1)  # ReduceOp.AVG
            return
        if not self.ring or self.x.numel() == 0:
            return
        x, s = self.x, self.self_
        if self.k == 1:
            t = self.left - s
        else:
            t = (self.left + self.right).sub_(s * 2)
        x.add_(t.mul_(self.w))
        diff = x - s
        self.codec.encode(diff, out=self.q)
        self.codec.decode(self.q, s.numel(), out=s, accumulate=True)

    def peers(self):
        left, right = (self.rank - 1) % self.n, (self.rank + 1) % self.n
        return [left] if self.k == 1 else [left, right]

    def send(self, tp) -> None:
        if not self.ring or self.x.numel() == 0:
            return
        peers = self.peers()
        nbytes = self.q.numel()
        tp.exchange([(p, self.q) for p in peers], [(p, self.recv[i * nbytes:(i + 1) * nbytes])
                                                    for i, p in enumerate(peers)])

    def receive(self) -> None:
        if not self.ring or self.x.numel() == 0:
            return
        nbytes, count = self.q.numel(), self.x.numel()
        self.codec.decode(self.recv[:nbytes], count, out=self.left, accumulate=True)
        if self.k == 2:
            self.codec.decode(self.recv[nbytes:], count, out=self.right, accumulate=True)


def _orthogonalize(mat: torch.Tensor, eps: float) -> None:
    """Gram-Schmidt on the columns of mat (rows x k), in place, as torch's PowerSGD hook does."""
    k = mat.shape[1]
    for i in range(k):
        col = mat[:, i:i + 1]
        norm = torch.linalg.vector_norm(col)
        col.div_(norm + eps if eps else norm)
        if i + 1 < k:
            rest = mat[:, i + 1:]
            rest.sub_(torch.sum(col * rest, dim=0) * col)


class PowerSgdOp:
    """PowerSGD's bucket (ops::PowerSgdBucketOp, torch's powerSGD_hook) on the device: with error
    feedback M = g + e; the uncompressed runs and every matrix's P = M Q (Q orthogonalized) summed
    in one allreduce, P orthogonalized, Q = M^T P summed and divided by the ranks, then
    g = P Q^T and e = M - P Q^T. P, Q and the uncompressed values cross the wire in wire_dtype
    (rounded to it even on one rank, as the C++ op does). The matrix products are torch's, so the
    results agree with the C++ op to float32 rounding, not bit for bit."""

    def __init__(self, matrices, uncompressed, count: int, p: torch.Tensor, q: torch.Tensor,
                 error: Optional[torch.Tensor], eps: float, wire_dtype: torch.dtype):
        self.matrices = list(matrices)  # (offset, n, m, k, p_off, q_off)
        self.uncompressed = list(uncompressed)  # (offset, count)
        self.count, self.p, self.q, self.error = count, p, q, error
        self.eps, self.wire = float(eps), wire_dtype
        self.p_count = sum(n * k for _, n, _, k, _, _ in self.matrices)
        self.q_count = sum(m * k for _, _, m, k, _, _ in self.matrices)
        self.compressing = False
        self.warmup = AllreduceOp(1)  # ReduceOp.AVG

    def _sum(self, buf: torch.Tensor, tp) -> None:
        if buf.numel() == 0:
            return
        if self.wire == torch.float32:
            if tp.size > 1:
                tp.allreduce(buf, 0)  # ReduceOp.SUM
            return
        w = buf.to(self.wire)
        if tp.size > 1:
            tp.allreduce(w, 0)
        buf.copy_(w)

    def launches_only(self, tp) -> bool:
        # Compressing, it launches dozens of small kernels: the worker's thread does that
        # beside backward's launches rather than on the autograd thread between them.
        return not self.compressing

    def run(self, g: torch.Tensor, tp) -> None:
        if not self.compressing:
            self.warmup.run(g, tp)
            return
        ranks = torch.full((1,), float(tp.size), dtype=torch.float32, device=g.device)
        unc = sum(c for _, c in self.uncompressed)
        send = torch.empty(unc + self.p_count, dtype=torch.float32, device=g.device)
        u = 0
        for off, c in self.uncompressed:
            send[u:u + c].copy_(g[off:off + c])
            u += c
        mats = []
        for off, n, m, k, p_off, q_off in self.matrices:
            q = self.q[q_off:q_off + m * k].view(m, k)
            _orthogonalize(q, self.eps)
            if self.error is not None:
                a = self.error[off:off + n * m].view(n, m)
                a.add_(g[off:off + n * m].view(n, m))
            else:
                a = g[off:off + n * m].view(n, m)
            torch.matmul(a, q, out=send[unc + p_off:unc + p_off + n * k].view(n, k))
            mats.append((off, n, m, k, p_off, q_off, a))
        self._sum(send, tp)
        u = 0
        for off, c in self.uncompressed:
            torch.div(send[u:u + c], ranks, out=g[off:off + c])
            u += c
        if not mats:
            return
        self.p[:self.p_count].copy_(send[unc:])
        for off, n, m, k, p_off, q_off, a in mats:
            p = self.p[p_off:p_off + n * k].view(n, k)
            _orthogonalize(p, self.eps)
            torch.matmul(a.t(), p, out=self.q[q_off:q_off + m * k].view(m, k))
        self._sum(self.q[:self.q_count], tp)
        self.q[:self.q_count].div_(ranks)
        for off, n, m, k, p_off, q_off, a in mats:
            approx = self.p[p_off:p_off + n * k].view(n, k) @ self.q[q_off:q_off + m * k].view(m, k).t()
            if self.error is not None:
                a.sub_(approx)  # error <- (M + error) - P Q^T
            g[off:off + n * m].view(n, m).copy_(approx)

    def __repr__(self) -> str:
        return f"PowerSgdOp(compressing={self.compressing}, matrices={len(self.matrices)})"
