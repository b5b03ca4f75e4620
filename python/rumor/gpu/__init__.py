"""The GPU path underneath the collectives: which transport a call on CUDA tensors takes
(routing), NCCL (nccl), the watch over work queued without a host wait (watch), host staging
(staging) and the CUDA collectives themselves (collectives). Internal: the API is rumor.*."""
