"""megakernel.probe_summary: the per-CTA cycle slots of csrc/megakernel/forward.cuh
(ProbeSlot) summed and turned into per-K-step and per-task means (CPU)."""

import torch

from megatron_mok import megakernel


def test_probe_summary_sums_ctas_and_derives_means():
    probe = torch.zeros(3, megakernel.PROBE_SLOTS, dtype=torch.int64)
    # CTA 0: 2 fc1 tasks, 10 K steps, 12 000 mainloop and 900 epilogue cycles; fc2 1 task.
    probe[0, 0:4] = torch.tensor([2, 10, 12_000, 900])
    probe[0, 4:8] = torch.tensor([1, 4, 5_000, 700])
    probe[1, 0:4] = torch.tensor([1, 5, 6_000, 300])
    probe[2, 8] = 400   # queue wait
    probe[2, 9] = 250   # producer dependency wait
    probe[2, 12:16] = 10 ** 12  # scratch timestamps must not leak into the sums
    s = megakernel.probe_summary(probe)
    assert s["fc1"]["tasks"] == 3 and s["fc1"]["k_steps"] == 15
    assert s["fc1"]["cycles_per_k_step"] == 18_000 / 15
    assert s["fc1"]["epilogue_cycles_per_task"] == 1_200 / 3
    assert s["fc2"]["cycles_per_k_step"] == 5_000 / 4
    assert s["queue_wait_cycles"] == 400 and s["dependency_wait_cycles"] == 250
    assert s["consumer_cycles"] == 18_000 + 1_200 + 5_000 + 700 + 400


def test_probe_summary_of_an_empty_launch():
    s = megakernel.probe_summary(torch.zeros(2, megakernel.PROBE_SLOTS, dtype=torch.int64))
    assert s["fc1"]["cycles_per_k_step"] == 0.0 and s["consumer_cycles"] == 0
