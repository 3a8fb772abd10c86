"""NVMe parameter offload (`offload_param: {device: nvme}`, ZeRO-Infinity) without holding the rank's share in host
memory.

`zero.Init` swaps each partition out as soon as it is made. A load reads many partitions at once, so here the reads
run in waves: destinations in file order, at most `budget_bytes` of them per wave (or one destination, if larger);
after each wave its partitions go to their swap files and their host memory is freed
(`Zero3Partitioner.swap_out`). Partitions of missing keys stay in memory until their init has run (finalize), and
so do those DeepSpeed's swapper does not take (under 1 MiB, persistent, or not in the engine's dtype), as
`zero.Init` leaves them. The host then holds at most one wave of loaded partitions on top of DeepSpeed's own swap
buffers. A rank receiving its bytes from another rank (streaming) swaps partitions out the same way, in waves of
those its stream has completed (`SwapOutAsCompleted`).
"""

from __future__ import annotations

from .reader import file_order


def waves(jobs: list[tuple], budget_bytes: int) -> list[list[tuple]]:
    """(item, checkpoint entry, destination) jobs grouped by destination, in file order of each destination's first
    read, cut into waves of at most `budget_bytes` of destinations (a larger destination is a wave of its own)."""
    by_destination: dict[int, list[tuple]] = {}
    for job in jobs:
        by_destination.setdefault(id(job[2]), []).append(job)
    groups = sorted(by_destination.values(), key=lambda group: min(file_order(item, entry) for item, entry, _ in group))
    out, wave, size = [], [], 0
    for group in groups:
        dst = group[0][2]
        nbytes = dst.numel() * dst.element_size()
        if wave and size + nbytes > budget_bytes:
            out.append(wave)
            wave, size = [], 0
        wave.extend(group)
        size += nbytes
    if wave:
        out.append(wave)
    return out


def read_in_waves(jobs: list[tuple], read, partitioner, budget_bytes: int) -> dict:
    """`read(wave_jobs)` for each wave, then the wave's NVMe partitions swapped out. Returns what it did."""
    largest = 0
    planned = waves(jobs, budget_bytes)
    for wave in planned:
        read(wave)
        destinations = list({id(dst): dst for _, _, dst in wave}.values())
        largest = max(largest, sum(dst.numel() * dst.element_size() for dst in destinations))
        partitioner.swap_out(destinations)
    return {"waves": len(planned), "largest_wave_bytes": largest, "wave_budget_bytes": budget_bytes}


class SwapOutAsCompleted:
    """Streaming under NVMe offload: called with each partition the stream has filled completely; swaps them out in
    waves of at least `budget_bytes` (the last one at `flush`)."""

    def __init__(self, partitioner, budget_bytes: int):
        self.partitioner, self.budget_bytes = partitioner, budget_bytes
        self.pending, self.pending_bytes, self.waves, self.largest = [], 0, 0, 0

    def __call__(self, partition) -> None:
        if id(partition) not in self.partitioner.nvme_params:  # not the swapper's: stays in memory
            return
        self.pending.append(partition)
        self.pending_bytes += partition.numel() * partition.element_size()
        if self.pending_bytes >= self.budget_bytes:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.partitioner.swap_out(self.pending)
            self.waves += 1
            self.largest = max(self.largest, self.pending_bytes)
            self.pending, self.pending_bytes = [], 0

    def summary(self) -> dict:
        return {"waves": self.waves, "largest_wave_bytes": self.largest, "wave_budget_bytes": self.budget_bytes}
