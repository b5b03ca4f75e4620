"""The Algorithm extension point of rumor.DistributedDataParallel (see docs/algorithms.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING, FrozenSet, List

from ..engine.buckets import default_bucket_plan

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.buckets import Bucket
    from ..parallel import DistributedDataParallel


class Algorithm:
    """Decides what the training engine communicates and how.

    The engine owns the mechanics: gradients live as views into flat bucket buffers, each
    parameter's post-accumulate-grad hook marks it ready, complete buckets are handed, in bucket
    order, to the C++ comm thread while backward goes on, and the end of backward waits for them.
    An algorithm chooses:

    - ``plan_buckets``: how parameters are grouped into buckets (default: by dtype, in the order
      gradients become ready, capped at bucket_cap_mb with a small first bucket);
    - ``bucket_op``: which C++ op runs on a bucket (``rumor._C.allreduce_op(...)`` and, as
      algorithms are added, their own ops);
    - hooks around the step: ``init`` (once, after wrapping), ``before_forward``,
      ``after_backward`` (after every bucket finished) and ``after_step`` (after optimizer.step,
      when an optimizer was given to the wrapper).
    """

    # rumor.elastic restores a job from one rank's commit. An algorithm whose ranks end a step
    # with identical weights and no state of its own sets elastic_replicated; one whose ranks
    # hold different replicas sets elastic_consensus (a commit then saves the ranks' average of
    # weights and optimizer state). State of the algorithm's own goes through
    # elastic_state_dict() -> picklable and load_elastic_state_dict(sd), called after the model
    # and optimizer were loaded. Algorithms with none of these are refused by rumor.elastic.State.
    elastic_replicated = False
    elastic_consensus = False
    # Live membership (rumor-run --live) runs an algorithm whose ranks end every step with the
    # same weights: one with elastic_replicated, or one with elastic_live that also keeps state
    # across steps (1-bit Adam's momenta, PowerSGD's P/Q) and implements the two hooks below:
    # how a step given up is undone, and what becomes of each rank's own state (error feedback)
    # when the world changes. docs/elastic.md has the rule of each algorithm.
    elastic_live = False
    # An algorithm whose ranks train alone between averages (LocalSGD, DiLoCo) runs live by
    # rounds instead: elastic_live_rounds, and elastic_live_at_boundary() says whether the last
    # step ended with an average over every rank. rumor.elastic keeps the whole State at each
    # round's start, gives up a round a failure interrupts (every member goes back to its start)
    # and admits newcomers only between rounds.
    elastic_live_rounds = False
    # An elastic_live algorithm whose steps may communicate nothing on the training thread
    # (AsyncModelAverage after its warm-up) sets elastic_live_quiet: every optimizer step then
    # checks whether live membership's watcher ended the epoch, since no collective of the
    # step would fail to say so.
    elastic_live_quiet = False
    # rumor.elastic.verify compares the replicas' state; keys named here (of the optimizer's
    # per-parameter state and of elastic_state_dict()) are each rank's own, e.g. error feedback,
    # and are left out of the comparison.
    parity_own_keys: tuple = ()
    # The autotuner (rumor.autotune) may change the bucket layout between steps only for an
    # algorithm whose every step is one synchronous exchange of the gradient buckets: then the
    # step time is what its knobs change, and rebuilding the buckets is all a new setting needs.
    tunable_buckets = False

    def elastic_live_mark(self) -> None:
        """Live membership, on algorithms with elastic_live: called after every optimizer step a
        member applied, and once the state of a new epoch is in place. The algorithm keeps what
        elastic_live_undo() needs to put its state back as it is now; nothing on the base class.
        """

    def elastic_live_undo(self) -> None:
        """Live membership, on algorithms with elastic_live: called on every surviving member when
        its epoch ends, before the wrapper is built again over the new world. The step in flight
        is given up (and redone), so the algorithm puts back the state of the last
        elastic_live_mark() and applies its rule for each rank's own state on a change (see
        docs/elastic.md); nothing on the base class. Called again, it does the same.
        """

    def elastic_live_at_boundary(self) -> bool:
        """Live membership, on algorithms with elastic_live_rounds: whether the replicas are at a
        round boundary (the last step ended with an average over every rank).

        Returns:
            True on the base class (every step is a round).
        """
        return True

    def init(self, ddp: "DistributedDataParallel") -> None:
        """Called once, after parameters were broadcast and buckets built.

        Args:
            ddp: the DistributedDataParallel wrapper this algorithm drives.
        """

    def plan_buckets(self, ddp: "DistributedDataParallel", params: List, cap_bytes: int,
                     first_cap_bytes: int, breaks: FrozenSet[int] = frozenset()) -> List[List[int]]:
        """Returns lists of indices into ``params`` (given in expected ready order), one list per
        bucket, each of a single dtype. Buckets are launched in the order returned. ``breaks``
        holds positions whose gradient arrived well after the previous one (measured in the
        first iteration): a bucket should not span them.

        Args:
            ddp: the wrapper.
            params: the parameters that need gradients, in expected ready order.
            cap_bytes: the most bytes a bucket holds (the wrapper's bucket_cap_mb).
            first_cap_bytes: the cap of the first bucket (the wrapper's first_bucket_mb), small
                so that communication starts early in backward.
            breaks: positions in ``params`` a bucket must not span; empty by default.

        Returns:
            One list of indices into ``params`` per bucket.
        """
        return default_bucket_plan(params, cap_bytes, first_cap_bytes, breaks)

    def bucket_op(self, ddp: "DistributedDataParallel", bucket: "Bucket"):
        """The C++ op the comm thread runs on a ready bucket of CPU parameters.

        Args:
            ddp: the wrapper.
            bucket: the bucket (its flat gradient buffer and parameter indices).

        Returns:
            An op built by ``rumor._C`` (for instance ``allreduce_op``), or None for none.

        Raises:
            NotImplementedError: on the base class; every algorithm defines it.
        """
        raise NotImplementedError

    # Parameters on a CUDA device (docs/gpu.md). Where has_device_ops(ddp, nccl) says so (nccl:
    # whether the group's GPU transport is NCCL), every bucket runs device_bucket_op()'s op
    # (rumor.engine.ops) on the device. Otherwise, an algorithm whose bucket_op touches nothing but
    # the bucket sets stages_through_host: its CPU op then runs on a page-locked host copy of
    # each bucket. An algorithm with neither is refused for CUDA parameters.
    stages_through_host = False

    def has_device_ops(self, ddp: "DistributedDataParallel", nccl: bool) -> bool:
        """Whether buckets of CUDA parameters run device_bucket_op()'s op on the device.

        Args:
            ddp: the wrapper.
            nccl: whether the group's GPU transport is NCCL.

        Returns:
            False on the base class (CUDA buckets are staged through the host, if
            stages_through_host allows it, or refused).
        """
        return False

    def device_bucket_op(self, ddp: "DistributedDataParallel", bucket: "Bucket"):
        """The device op (rumor.engine.ops) run on a ready bucket of CUDA parameters; called only
        where has_device_ops() returned True.

        Args:
            ddp: the wrapper.
            bucket: the bucket of CUDA gradients.

        Raises:
            NotImplementedError: on the base class.
        """
        raise NotImplementedError

    def rebuild_buckets(self, ddp: "DistributedDataParallel") -> bool:
        """Whether to rebuild the buckets in the observed ready order after the first iteration.
        The rebuild is a collective on the wrapper's group (the first rank's order is broadcast)
        at the end of the first backward; an algorithm whose backward communicates nothing, and
        whose ranks need not be in step, may return False.

        Args:
            ddp: the wrapper.

        Returns:
            True on the base class.
        """
        return True

    def before_forward(self, ddp: "DistributedDataParallel") -> None:
        """Hook run at the start of every forward of the wrapper; does nothing on the base class.

        Args:
            ddp: the wrapper.
        """

    def after_backward(self, ddp: "DistributedDataParallel") -> None:
        """Hook run at the end of every backward, after every bucket's op finished; does nothing
        on the base class.

        Args:
            ddp: the wrapper.
        """

    def after_step(self, ddp: "DistributedDataParallel") -> None:
        """Hook run after every optimizer.step() of the optimizer given to the wrapper; does
        nothing on the base class.

        Args:
            ddp: the wrapper.
        """


