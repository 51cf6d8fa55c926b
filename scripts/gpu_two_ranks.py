"""Two ranks on one GPU, without hvdmagic: what NCCL and Gloo do with CUDA tensors there.

    horovodrun --gloo -np 2 -H localhost:2 python scripts/gpu_two_ranks.py horovod
    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_two_ranks.py nccl|gloo

scripts/gpu_check.sh runs each under a deadline and puts the outcome in its report; hvdmagic's
paragraph before such a launch (hvdmagic/launch/local.py) says what these find.
"""

import os
import sys

import torch

which = sys.argv[1]
torch.cuda.set_device(0)
t = torch.ones(2, device="cuda")
if which == "horovod":
    import horovod.torch as hvd

    hvd.init()
    rank, reduced = hvd.rank(), hvd.allreduce(t, op=hvd.Sum)
else:
    import torch.distributed as dist

    dist.init_process_group(which, device_id=torch.device("cuda", 0) if which == "nccl" else None)
    dist.all_reduce(t)
    rank, reduced = dist.get_rank(), t
torch.cuda.synchronize()
print(f"rank {rank} (pid {os.getpid()}): {which} allreduce of a CUDA tensor gave {reduced.tolist()}", flush=True)
