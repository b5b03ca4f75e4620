"""The advisor (rumor.advise): measures a job and predicts which rumor algorithm trains it fastest
(docs/advisor.md).

Inside a job (every rank, after rumor.init())::

    advice = rumor.advise(model, optimizer, (inputs, targets))
    print(advice.best["algorithm"])

From the command line: rumor.advisor.cli.

One module per job: measure (the collective probes), model (the prediction model, pure
arithmetic), advice (advise() and the Advice it returns), report (the table), cli, script (an
ordinary training script, measured at its first step through the wrapper).
"""
from .advice import Advice, advise, build_algorithm
from .cli import SCRIPT_HOOK, main
from .model import (
    AMA_INTERVAL_MS,
    AMA_MAX_BUSY,
    ASYNC,
    COMPRESSED,
    COMPRESSED_EF,
    DECENTRALIZED,
    DECENTRALIZED_LP,
    DILOCO,
    DILOCO_H,
    EXACT,
    HALF,
    LOCAL_SGD,
    LOCAL_SGD_EVERY,
    MARGIN,
    PER_STEP_SYNC,
    POWERSGD,
    POWERSGD_RANK,
    SPLIT_GAP_S,
    STREAMING,
    STREAMING_FRAGMENTS,
    TORCH_FIRST_BUCKET,
    UNSYNCHRONIZED_STEPS,
    Link,
    bucket_plan,
    predict,
    predict_torch,
    rank_rows,
    torch_bucket_plan,
)
from .report import format_table

__all__ = [
    "AMA_INTERVAL_MS", "AMA_MAX_BUSY", "ASYNC", "Advice", "COMPRESSED", "COMPRESSED_EF", "DECENTRALIZED",
    "DECENTRALIZED_LP", "DILOCO", "DILOCO_H", "EXACT", "HALF", "LOCAL_SGD", "LOCAL_SGD_EVERY", "Link", "MARGIN",
    "PER_STEP_SYNC", "POWERSGD", "POWERSGD_RANK", "SCRIPT_HOOK", "SPLIT_GAP_S", "STREAMING", "STREAMING_FRAGMENTS",
    "TORCH_FIRST_BUCKET", "UNSYNCHRONIZED_STEPS", "advise", "bucket_plan", "build_algorithm", "format_table", "main",
    "predict", "predict_torch", "rank_rows", "torch_bucket_plan",
]
