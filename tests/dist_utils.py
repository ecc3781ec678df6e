"""Run a function on N CPU processes joined by a gloo group (loopback only)."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args):
    import faulthandler
    import sys
    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # every rank is done with its collectives before any tears down
    except BaseException:
        dist.destroy_process_group()
        raise  # spawn reports it
    dist.destroy_process_group()
    # Leave without interpreter teardown: now and then a gloo/TCPStore background thread
    # was still joinable when static destructors ran, and std::terminate aborted a rank
    # that had finished its work (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size, *args):
    """fn(rank, world_size, *args) on every rank; a rank's exception fails the caller."""
    mp.start_processes(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size,
                       join=True, start_method="spawn")
