"""The data-parallel engine underneath DistributedDataParallel and the algorithms: buckets,
flat weights, and the device engine that runs bucket operations on GPUs (docs/architecture.md)."""
