"""Routing errors of the kernel backend, raised without a host sync in the pass.

A routing the row table cannot hold (overflow) or an expert id outside [-1, E) is found
on the GPU, by the schedule. Its first occurrence is latched in a sticky status word per
device (csrc/comm/routing_status.h); after every schedule an asynchronous copy takes it
to pinned host memory (a small ring of copies, each with its event). The host reads a
copy only once its event has completed, so reading never waits for the GPU:

- every kernel-backend layer call (forward and backward) polls the completed copies and
  raises `RoutingError` at the first bad one: the error surfaces at a later layer call of
  the same step, at the latest at the next step's first MoE layer;
- `check(wait=True)` waits for the latest copy and raises; Megatron's adapter calls it
  in `finalize_model_grads` (before the optimizer step, which synchronises anyway), so
  an overflowing step never updates the weights (docs/reliability.md).

Until then the pass is contained: a dropped route adds nothing (its slot is zeroed on the
source rank), an invalid id is treated as no route.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# csrc/comm/routing_status.h
OVERFLOW, INVALID_IDS = 1, 2
(BITS, OVERFLOW_RANK, ROWS_NEEDED, CAPACITY, BUSIEST_EXPERT, BUSIEST_ROWS, DROPPED_ROUTES,
 EP_SIZE, TOKENS, TOPK, LOCAL_EXPERTS, INVALID_RANK, INVALID_TOKEN, INVALID_K, INVALID_VALUE,
 INVALID_COUNT) = range(16)
STATUS_SIZE = 16
_RING = 4  # copies in flight per device


class RoutingError(RuntimeError):
    """The routing of a pass could not run as given (overflow or invalid expert ids)."""


class _DeviceLatch:
    """The status word of one device and its ring of pinned copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self.status = torch.zeros(STATUS_SIZE, dtype=torch.int32, device=device)
        # Row _RING: the copy a captured CUDA graph makes (no event: read after a sync).
        self.copies = torch.zeros(_RING + 1, STATUS_SIZE, dtype=torch.int32, pin_memory=True)
        self.rows = self.copies.numpy()  # the same pinned memory, read without tensor ops
        self.events: list[Optional[torch.cuda.Event]] = [None] * _RING
        self.unread: set = set()  # slots whose copy is queued and not yet read clean
        self.next = 0
        self.captured = False

    def record(self) -> None:
        """Copy the status to the host after the work queued so far. A ring slot whose
        copy is still in flight is skipped (the word is sticky: a later copy carries any
        error)."""
        if torch.cuda.is_current_stream_capturing():  # no event queries inside a capture
            self.copies[_RING].copy_(self.status, non_blocking=True)
            self.captured = True
            return
        slot = self.next
        event = self.events[slot]
        if event is not None and not event.query():
            return
        self.copies[slot].copy_(self.status, non_blocking=True)
        if event is None:
            event = self.events[slot] = torch.cuda.Event()
        event.record()
        self.unread.add(slot)
        self.next = (slot + 1) % _RING

    def poll(self, wait: bool = False) -> None:
        """Read the copies that completed since the last poll (each once: a clean copy
        stays clean); raise RoutingError at the first that shows an error."""
        if torch.cuda.is_current_stream_capturing():
            return
        ready = sorted(self.unread)
        if wait:
            if self.captured:  # graph replays copy without an event
                torch.cuda.synchronize(self.device)
                ready.append(_RING)
            latest = self.events[(self.next - 1) % _RING]
            if latest is not None:
                latest.synchronize()
        for slot in ready:
            if slot < _RING:
                if not self.events[slot].query():
                    continue
                self.unread.discard(slot)
            if self.rows[slot, BITS]:
                record = self.rows[slot].tolist()
                self.clear()
                raise RoutingError(describe(record))

    def clear(self) -> None:
        """Forget the latched error: in-flight copies still show it, so they are voided."""
        self.status.zero_()
        self.events = [None] * _RING
        self.unread.clear()
        self.copies.zero_()


_LATCHES: dict = {}


def status_tensor(device: torch.device) -> torch.Tensor:
    """The sticky status word the schedule of `device` writes (int32 [16])."""
    return _latch(device).status


def _latch(device: torch.device) -> _DeviceLatch:
    key = (device.type, device.index)
    latch = _LATCHES.get(key)
    if latch is None:
        latch = _LATCHES[key] = _DeviceLatch(device)
    return latch


def record(device: torch.device) -> None:
    """Queue the copy of `device`'s status after the schedule just built (no sync)."""
    if device.type == "cuda":
        _latch(device).record()


def poll(device: torch.device) -> None:
    """Raise RoutingError if a completed copy shows an error (never waits)."""
    if device.type == "cuda" and (device.type, device.index) in _LATCHES:
        _latch(device).poll(wait=False)


def clear(device: torch.device) -> None:
    """Forget `device`'s latched error once a caller has reported it through a host sync
    (Schedule.check_errors), so the next pass does not raise it again."""
    if device.type == "cuda" and (device.type, device.index) in _LATCHES:
        _latch(device).clear()


def check(wait: bool = True) -> None:
    """Raise RoutingError for any routing error latched on any device. wait=True waits for
    the latest schedule's copy (a host sync: call it where the caller syncs anyway, such
    as before the optimizer step)."""
    for latch in list(_LATCHES.values()):
        latch.poll(wait=wait)


def describe(record: list) -> str:
    """The error message of a status record: which rank, expert, rows, capacity and flag."""
    parts = []
    if record[BITS] & OVERFLOW:
        ep, tokens, topk = record[EP_SIZE], record[TOKENS], record[TOPK]
        needed = _multiplier_needed(record[ROWS_NEEDED], tokens, topk, ep,
                                    record[LOCAL_EXPERTS])
        parts.append(
            f"megatron_mok: routing overflow on EP rank {record[OVERFLOW_RANK]}: its routing "
            f"needs {record[ROWS_NEEDED]} rows (128-row padded per expert) but the row table "
            f"holds {record[CAPACITY]}; expert {record[BUSIEST_EXPERT]} alone received "
            f"{record[BUSIEST_ROWS]} routes of the {ep} x {tokens} x {topk} in the pass, and "
            f"{record[DROPPED_ROUTES]} routes were left out (they added nothing to the output). "
            f"Raise --mok-capacity-multiplier / MoKConfig.schedule_capacity_multiplier to at "
            f"least {needed:.3g} (the table holds max(2, EP x multiplier) x T x K rows).")
    if record[BITS] & INVALID_IDS:
        parts.append(
            f"megatron_mok: topk_idx holds {record[INVALID_COUNT]} expert ids outside "
            f"[-1, num_experts); the first: {record[INVALID_VALUE]} at token "
            f"{record[INVALID_TOKEN]}, k = {record[INVALID_K]} of EP rank "
            f"{record[INVALID_RANK]} (those routes were treated as -1, no route).")
    return "\n".join(parts)


def _multiplier_needed(rows: int, tokens: int, topk: int, ep_size: int,
                       local_experts: int) -> float:
    """The smallest schedule_capacity_multiplier whose table holds `rows` padded rows
    (config.schedule_capacity: max(2, EP m) T K rows plus 127 per local expert)."""
    fraction = max(0, rows - local_experts * 127) / max(1, tokens * topk)
    return math.ceil(fraction / max(1, ep_size) * 100) / 100
