"""Two ranks over rumor's CPU collectives; rank 1 exits after a first allreduce and rank 0 must
raise PeerError from its second. Plain subprocesses without faulthandler, so that a crash reaches
scripts/debug/segv_backtrace.c with the faulting registers (the GPU machine's crash, docs/gpu.md).
    LD_PRELOAD=/tmp/segv.so python scripts/debug/peer_exit.py; python scripts/debug/segv_report.py
"""
import os
import socket
import subprocess
import sys
import time


def rank_main() -> None:
    import torch

    import rumor

    rumor.init()
    r = rumor.rank()
    x = torch.ones(1 << 16)
    rumor.allreduce(x)
    rumor.barrier()
    if r == 1:
        os._exit(3)
    time.sleep(0.5)
    try:
        rumor.allreduce(x)
    except rumor.RumorError as e:
        print(f"rank 0 raised {type(e).__name__}: {str(e)[:160]}", flush=True)
        return
    print("rank 0: nothing raised", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    if os.environ.get("PEER_EXIT_RANK"):
        rank_main()
        sys.exit(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, PEER_EXIT_RANK="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RUMOR_TIMEOUT="20")
        env.pop("PYTHONFAULTHANDLER", None)
        procs.append(subprocess.Popen([sys.executable, __file__], env=env))
    rc = [p.wait(timeout=90) for p in procs]
    print("exit codes", rc)
    sys.exit(0 if rc[0] == 0 else 1)
