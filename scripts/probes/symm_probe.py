"""Probe: symmetric memory between 2 processes on one GPU (gloo group), peer writes visible."""
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611",
                      TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed._symmetric_memory as symm
    try: symm.set_backend("CUDA")
    except Exception as e: print("set_backend", e)
    t = symm.empty(1024, dtype=torch.int64, device="cuda")
    h = symm.rendezvous(t, dist.group.WORLD)
    t.fill_(rank + 100)
    torch.cuda.synchronize(); dist.barrier()
    peer = h.get_buffer(1 - rank, (1024,), torch.int64)
    print(rank, "peer sees", int(peer[0]), "ptrs", [hex(p) for p in h.buffer_ptrs], "sig", h.signal_pad_size, flush=True)
    dist.barrier()
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.start_processes(main, args=(2,), nprocs=2, start_method="spawn")
