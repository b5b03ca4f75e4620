"""rumor's algorithms in PyTorch Lightning: ``Trainer(strategy=RumorStrategy(...))`` or
``Trainer(strategy="rumor")`` after ``import rumor.lightning`` (docs/lightning.md).

RumorStrategy is Lightning's DDPStrategy with rumor.DistributedDataParallel in place of torch's
wrapper. Lightning's own collectives (barrier, broadcast, reduce, ``self.log(sync_dist=True)``)
keep going through torch.distributed, whose default group runs on rumor's "rumor" backend
(rumor.torch_backend); rumor.init() then meets its peers through that group's store, so one
rendezvous serves both.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import warnings
from typing import Any, Dict, Mapping, Optional, Union

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.distributed import _init_dist_connection
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError("rumor.lightning needs PyTorch Lightning 2.x: pip install 'rumor[lightning]' "
                      "(or pip install lightning)") from e

from . import _runtime
from .algorithms import (Algorithm, AsyncModelAverage, ByteGrad, Decentralized, DiLoCo, GradientAllReduce,
                         LocalSGD, LowPrecision, LowPrecisionDecentralized, OneBitAdamAlgorithm, PowerSGD, QSGD,
                         StreamingDiLoCo)
from .parallel import DistributedDataParallel

__all__ = ["RumorStrategy", "ALGORITHMS"]

_log = logging.getLogger(__name__)

# Names are matched without case, "_" or "-": "gradient_allreduce", "GradientAllReduce" and
# "gradient-allreduce" are one name. Bagua's Lightning names ("gradient_allreduce", "bytegrad",
# "decentralized", "low_precision_decentralized", "async") are among them.
ALGORITHMS: Dict[str, type] = {
    "gradient_allreduce": GradientAllReduce,
    "bytegrad": ByteGrad,
    "qsgd": QSGD,
    "low_precision": LowPrecision,
    "fp16": LowPrecision,
    "onebit_adam": OneBitAdamAlgorithm,
    "decentralized": Decentralized,
    "low_precision_decentralized": LowPrecisionDecentralized,
    "async_model_average": AsyncModelAverage,
    "async": AsyncModelAverage,
    "powersgd": PowerSGD,
    "local_sgd": LocalSGD,
    "diloco": DiLoCo,
    "streaming_diloco": StreamingDiLoCo,
}

_CHECKPOINT_KEY = "rumor_algorithm"


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


_BY_NORM = {_norm(k): v for k, v in ALGORITHMS.items()}
_BY_NORM.update({_norm(cls.__name__): cls for cls in ALGORITHMS.values()})


def _algorithm_class(algorithm: Union[str, type]) -> type:
    if isinstance(algorithm, type):
        if not issubclass(algorithm, Algorithm):
            raise TypeError(f"RumorStrategy: algorithm must be a rumor.algorithms.Algorithm (object, class or "
                            f"name), got the class {algorithm.__name__}")
        return algorithm
    cls = _BY_NORM.get(_norm(algorithm))
    if cls is None:
        raise ValueError(f"RumorStrategy: unknown algorithm {algorithm!r}; the names are "
                         f"{', '.join(sorted(ALGORITHMS))} (or an Algorithm object or class)")
    return cls


def _steps_optimizer(algorithm: Algorithm) -> bool:
    # An algorithm that acts after optimizer.step() needs the optimizer given to the wrapper.
    return type(algorithm).after_step is not Algorithm.after_step


class RumorStrategy(DDPStrategy):
    """Lightning's data-parallel strategy on rumor: the LightningModule is wrapped in
    rumor.DistributedDataParallel with any rumor algorithm.

    ::

        import lightning as L
        from rumor.lightning import RumorStrategy

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=RumorStrategy("bytegrad"))

    ``Trainer(strategy="rumor")`` is the same with GradientAllReduce (the name is registered in
    Lightning's StrategyRegistry when rumor.lightning is imported). Processes come from
    Lightning's launcher or from an outside one (``python -m rumor.run``, torchrun, Slurm):
    rumor.init() is called with Lightning's ranks and addresses. The optimizer of
    ``configure_optimizers`` is given to the wrapper (algorithms that act after the step need it;
    "onebit_adam" needs a rumor.optim.OneBitAdamOptimizer there). Checkpoints written through
    Lightning carry the algorithm's state_dict() (every rank's, under the key
    "rumor_algorithm") and resuming loads it back. At the end of fit AsyncModelAverage is
    finished (aborted after an error) and rumor is shut down.

    Args:
        algorithm: a rumor.algorithms.Algorithm object, an Algorithm class, or a name from
            rumor.lightning.ALGORITHMS (case, "_" and "-" do not matter); default
            "gradient_allreduce".
        accelerator: Lightning's argument; None lets the Trainer choose.
        parallel_devices: Lightning's argument; None lets the Trainer choose.
        cluster_environment: Lightning's argument; None lets the Trainer detect it.
        checkpoint_io: Lightning's argument; None for the default.
        precision_plugin: Lightning's argument; None for the default.
        process_group_backend: the torch.distributed backend of Lightning's own collectives;
            None (the default) means "rumor" on CPU and Lightning's default on CUDA.
        timeout: deadline of rumor's and the process group's blocking waits; None (the default)
            takes rumor's (env RUMOR_TIMEOUT, 300 s).
        ddp_kwargs: keyword arguments of rumor.DistributedDataParallel (bucket_cap_mb,
            find_unused_parameters, broadcast_buffers, ...); None for none.
        start_method: Lightning's argument: how its launcher starts processes ("popen", the
            default, "spawn", "fork" or "forkserver").
        **algorithm_kwargs: arguments of the algorithm's class when algorithm is a name or a
            class (for instance sync_every=4 for "local_sgd").

    Raises:
        TypeError: algorithm is not an Algorithm, class or name, or algorithm_kwargs come with
            an Algorithm object.
        ValueError: algorithm is an unknown name.
    """

    strategy_name = "rumor"

    def __init__(self, algorithm: Union[str, type, Algorithm] = "gradient_allreduce", *,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[datetime.timedelta] = None, ddp_kwargs: Optional[Dict[str, Any]] = None,
                 start_method: str = "popen", **algorithm_kwargs: Any) -> None:
        if isinstance(algorithm, Algorithm):
            if algorithm_kwargs:
                raise TypeError(f"RumorStrategy: keyword arguments {sorted(algorithm_kwargs)} are for building "
                                "the algorithm from a name or class; this one is an Algorithm object already")
            self._algorithm_class = type(algorithm)
        elif isinstance(algorithm, (str, type)):
            self._algorithm_class = _algorithm_class(algorithm)
        else:
            raise TypeError("RumorStrategy: algorithm must be a rumor.algorithms.Algorithm object, an Algorithm "
                            f"class or a name ({', '.join(sorted(ALGORITHMS))}), got {type(algorithm).__name__}")
        if ddp_kwargs is not None and not isinstance(ddp_kwargs, Mapping):
            raise TypeError(f"RumorStrategy: ddp_kwargs must be a dict of rumor.DistributedDataParallel "
                            f"arguments, got {type(ddp_kwargs).__name__}")
        ddp_kwargs = dict(ddp_kwargs or {})
        for reserved in ("module", "optimizer", "algorithm"):
            if reserved in ddp_kwargs:
                raise ValueError(f"RumorStrategy: ddp_kwargs may not hold {reserved!r}; the strategy passes it")
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"RumorStrategy: timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._algorithm_arg = algorithm
        self._algorithm_kwargs = algorithm_kwargs
        self._rumor_ddp_kwargs = ddp_kwargs
        self._rumor_timeout = timeout
        self._started_rumor = False
        self._failed = False
        self._algorithm: Optional[Algorithm] = None

    # ---- processes ----------------------------------------------------------------------------

    @property
    def algorithm(self) -> Optional[Algorithm]:
        """The algorithm of the last fit (None before the model was first wrapped). It stays
        after fit, so that trainer.save_checkpoint() afterwards still saves its state.

        Returns:
            The rumor.algorithms.Algorithm object, or None.
        """
        return self._algorithm

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        return "rumor" if self.root_device.type == "cpu" else super()._get_process_group_backend()

    def setup_distributed(self) -> None:
        """Joins the job: torch.distributed's default group for Lightning's collectives, then
        rumor.init() on the ranks and addresses of Lightning's cluster environment.

        Raises:
            RuntimeError: the launcher's RANK or WORLD_SIZE disagrees with Lightning's.
        """
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        env = self.cluster_environment
        assert env is not None
        timeout = self._rumor_timeout
        if timeout is None:
            timeout = datetime.timedelta(seconds=_runtime.env_float("RUMOR_TIMEOUT", _runtime.DEFAULT_TIMEOUT,
                                                                    positive=True))
        # Lightning's own launcher sets LOCAL_RANK and WORLD_SIZE but no RANK, which is what
        # rumor.init() reads; an outside launcher's values must be Lightning's too.
        for name, value in (("RANK", self.global_rank), ("WORLD_SIZE", self.world_size)):
            have = os.environ.get(name)
            if have is not None and have.strip() and have.strip() != str(value):
                raise RuntimeError(f"RumorStrategy: the environment's {name}={have} disagrees with Lightning's "
                                   f"{value} (devices={self.num_processes}, num_nodes={self.num_nodes}); make "
                                   "the Trainer's devices and num_nodes match the launcher's")
            os.environ[name] = str(value)
        kwargs: Dict[str, Any] = {"timeout": timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(env, self._process_group_backend, **kwargs)
        if not _runtime.is_initialized():
            os.environ.setdefault("MASTER_ADDR", env.main_address)
            os.environ.setdefault("MASTER_PORT", str(env.main_port))
            _runtime.init(timeout=timeout.total_seconds())
            self._started_rumor = True

    # ---- the model ----------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        """Lightning's DDPStrategy.setup with the optimizers set up before the model is wrapped,
        since rumor's wrapper hooks the optimizer.

        Args:
            trainer: the Trainer.
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self.configure_ddp()
        else:
            from lightning.pytorch.overrides.distributed import _sync_module_states
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _make_algorithm(self) -> Algorithm:
        arg = self._algorithm_arg
        if isinstance(arg, Algorithm):
            return arg
        cls = self._algorithm_class
        kwargs = dict(self._algorithm_kwargs)
        if cls is OneBitAdamAlgorithm:
            return cls(self._only_optimizer("onebit_adam"), **kwargs)
        if cls is LowPrecision and isinstance(arg, str) and _norm(arg) == "fp16":
            kwargs.setdefault("dtype", torch.float16)
        return cls(**kwargs)

    def _only_optimizer(self, why: str) -> torch.optim.Optimizer:
        if len(self.optimizers) != 1:
            raise ValueError(f"RumorStrategy: {why} needs exactly one optimizer from configure_optimizers, "
                             f"got {len(self.optimizers)}")
        return self.optimizers[0]

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        algorithm = self._algorithm = self._make_algorithm()
        optimizer = None
        if len(self.optimizers) == 1:
            optimizer = self.optimizers[0]
        elif _steps_optimizer(algorithm):
            optimizer = self._only_optimizer(type(algorithm).__name__)
        return DistributedDataParallel(model, optimizer=optimizer, algorithm=algorithm,
                                       device_ids=self.determine_ddp_device_ids(), **self._rumor_ddp_kwargs)

    def configure_ddp(self) -> None:
        """Wraps the LightningModule in rumor.DistributedDataParallel with the algorithm."""
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._setup_model(self.model)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: backward passes inside keep their gradients local (the
        wrapper's no_sync()).

        Yields:
            None.
        """
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    # ---- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Adds every rank's algorithm state to the checkpoint, then writes it on rank 0. Called on
        every rank (as Lightning does).

        Args:
            checkpoint: the dict Lightning built.
            filepath: where to write it.
            storage_options: passed to the CheckpointIO plugin.
        """
        algorithm = self.algorithm
        if algorithm is not None and hasattr(algorithm, "state_dict"):
            states = [algorithm.state_dict()]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                gathered = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(gathered, states[0])
                states = gathered
            checkpoint = dict(checkpoint)
            checkpoint[_CHECKPOINT_KEY] = {"algorithm": type(algorithm).__name__, "states": states}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads the optimizers' state, then the algorithm's: this rank's own where the
        checkpoint has one per rank of this world size, rank 0's otherwise. A checkpoint of
        another algorithm loads without it (with a warning).

        Args:
            checkpoint: the loaded checkpoint.
        """
        super().load_optimizer_state_dict(checkpoint)
        saved = checkpoint.get(_CHECKPOINT_KEY)
        algorithm = self.algorithm
        if saved is None or algorithm is None or not hasattr(algorithm, "load_state_dict"):
            return
        if saved.get("algorithm") != type(algorithm).__name__:
            warnings.warn(f"RumorStrategy: the checkpoint holds the state of {saved.get('algorithm')}, this run "
                          f"uses {type(algorithm).__name__}: the algorithm starts fresh", RuntimeWarning,
                          stacklevel=2)
            return
        states = saved["states"]
        algorithm.load_state_dict(states[self.global_rank] if len(states) == self.world_size else states[0])

    # ---- the end ------------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        """Remembers the failure, so that teardown aborts asynchronous averaging instead of
        waiting for the other ranks in AsyncModelAverage.finish().

        Args:
            exception: what Lightning caught.
        """
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Finishes (after an error: aborts) AsyncModelAverage, unwraps the model, removes the
        wrapper's hooks and shuts rumor down if this strategy started it."""
        ddp = self.model if isinstance(self.model, DistributedDataParallel) else None
        try:
            if ddp is not None and isinstance(ddp.algorithm, AsyncModelAverage):
                if self._failed:
                    try:
                        ddp.algorithm.abort()
                    except Exception as e:  # the failure being reported matters more
                        _log.warning("RumorStrategy: AsyncModelAverage.abort() after the error failed: %s", e)
                else:
                    ddp.algorithm.finish()
        finally:
            if ddp is not None:
                # The module Lightning keeps after teardown trains (or is wrapped again) without rumor.
                ddp.remove_hooks()
                self.model = ddp.module
            super().teardown()
            if self._started_rumor:
                self._started_rumor = False
                _runtime.shutdown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Registers "rumor" (GradientAllReduce) in Lightning's StrategyRegistry.

        Args:
            strategy_registry: Lightning's StrategyRegistry.
        """
        if "rumor" not in strategy_registry:
            strategy_registry.register("rumor", cls, description="rumor.DistributedDataParallel with GradientAllReduce "
                                       "(rumor.lightning.RumorStrategy)")


RumorStrategy.register_strategies(StrategyRegistry)
