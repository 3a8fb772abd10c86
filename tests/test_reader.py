"""The reader's page populating: destinations are mapped in one call before a read instead of faulting in one 4 KiB
page at a time (`reader.populate_for_write`), never changing a byte; `HF_ZERO3_LOADER_PREFAULT=0` turns it off.

The fault counts are deterministic: a populated range takes no page fault when written (a few for the test's own
stack and allocator), where the same range unpopulated takes one per page.
"""

from __future__ import annotations

import mmap
import resource
import warnings

import pytest
import torch

from hf_zero3_loader import reader as reader_module
from hf_zero3_loader.reader import PREFAULT_ENV, FileReader, OpenFiles, populate_for_write, populate_range

PAGES = 4096  # 16 MiB of 4 KiB pages


def _fresh(nbytes: int) -> torch.Tensor:
    """Memory never touched: its own anonymous mapping (an allocator could hand back pages already mapped)."""
    memory = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages, one fault each, even where huge pages are always on
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer: "the given buffer is not writable" does not apply to mmap
        return torch.frombuffer(memory, dtype=torch.uint8)


def _faults_while(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _can_populate() -> bool:
    populate_for_write(_fresh(PAGES * 4096))
    return reader_module._madvise is not None


@pytest.mark.skipif(not _can_populate(), reason="needs Linux >= 5.14 (MADV_POPULATE_WRITE)")
def test_a_populated_destination_takes_no_page_faults_when_written():
    cold = _fresh(PAGES * 4096)
    assert _faults_while(lambda: cold.fill_(1)) >= PAGES * 0.9  # the baseline: a fault per page

    fresh = _fresh(PAGES * 4096)
    populate_for_write(fresh)
    assert _faults_while(lambda: fresh.fill_(1)) < PAGES * 0.02


def test_populating_never_changes_data(tmp_path):
    data = torch.randint(0, 256, (PAGES * 4096 + 123,), dtype=torch.uint8)
    copy = data.clone()
    populate_for_write(data)
    populate_for_write(data[4097:4097 + 70000])  # unaligned: only the whole pages inside are touched
    populate_for_write(data[:100])  # below the threshold: nothing
    assert torch.equal(data, copy)


@pytest.mark.parametrize("prefault", ["1", "0"])
def test_reads_give_the_same_bytes_with_and_without_populating(tmp_path, monkeypatch, prefault):
    monkeypatch.setenv(PREFAULT_ENV, prefault)
    path = str(tmp_path / "bytes.bin")
    blob = torch.randint(0, 256, (3 * 1024 * 1024 + 77,), dtype=torch.uint8)
    blob.numpy().tofile(path)
    calls = []
    monkeypatch.setattr(reader_module, "populate_range",
                        lambda address, nbytes: calls.append(nbytes) or populate_range(address, nbytes))
    r = FileReader()
    assert r.prefault is (prefault == "1")
    # spans of odd sizes and offsets, adjacent on disk, landing in separate (unaligned) destinations
    sizes = [1, 4095, 4097, 65536 * 3 + 5, 1 << 20, 300_000]
    outs = [torch.empty(n + 3, dtype=torch.uint8)[3:] for n in sizes]
    r.read_spans(path, 11, outs)
    single = torch.empty(2 << 20, dtype=torch.uint8)
    r.read_into(path, 1000, single)
    r.close()
    pos = 11
    for out, n in zip(outs, sizes):
        assert torch.equal(out, blob[pos:pos + n])
        pos += n
    assert torch.equal(single, blob[1000:1000 + (2 << 20)])
    assert r.stats.bytes_read == sum(sizes) + (2 << 20)
    assert len(calls) == (len(sizes) + 1 if prefault == "1" else 0)  # every destination, or none when turned off
    # what the load report shows as bytes_populated: the whole pages inside the destinations of 64 KiB and more
    populated = prefault == "1" and reader_module._madvise is not None
    assert (r.stats.bytes_populated > (1 << 20) + (2 << 20) - 4 * 4096) if populated else r.stats.bytes_populated == 0


# -- reading a slice of each file: the kernel fetches only what is asked ---------------------------------------------

def _device_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _evict(path: str, probe: int) -> bool:
    """Drop the file's pages from the page cache; False where this filesystem keeps them (tmpfs, some overlays):
    reading the page at `probe` afterwards, without read-ahead, then fetches nothing from the device."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        before = _device_read_bytes()
        os.pread(fd, 4096, probe)
        return _device_read_bytes() > before
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="posix_fadvise")
@pytest.mark.parametrize("readahead", [False, True])
def test_a_reader_of_slices_fetches_only_its_bytes_from_the_device(tmp_path, readahead):
    """A machine holding one rank of 8 (the others on other machines) reads, in each stretch of the file, its run of
    consecutive pieces (its experts), then skips the other ranks' runs. With `readahead=False`, what the load picks
    then, the device delivers the bytes read; the kernel's read-ahead would fetch into the skipped runs, which other
    machines read (6.6x the bytes read on this VM). Only the bound without read-ahead is asserted: the amount with it
    depends on the kernel and device."""
    import os

    path = str(tmp_path / "runs.bin")
    piece, per_run, ranks, stretches = 64 << 10, 8, 8, 16  # 512 KiB runs, one of every 8: 8 MiB of a 64 MiB file
    torch.randint(0, 256, (piece * per_run * ranks * stretches,), dtype=torch.uint8).numpy().tofile(path)
    if not os.path.exists("/proc/self/io") or not _evict(path, probe=piece * per_run):  # a page of rank 1's run
        pytest.skip("cannot drop this file from the page cache here, or no I/O accounting")
    reader = FileReader(readahead=readahead)
    out = torch.empty(piece, dtype=torch.uint8)
    before = _device_read_bytes()
    for stretch in range(stretches):
        for i in range(per_run):
            reader.read_into(path, (stretch * ranks * per_run + i) * piece, out)
    fetched = _device_read_bytes() - before
    reader.close()
    wanted = stretches * per_run * piece
    assert reader.stats.bytes_read == wanted
    if not readahead:
        assert fetched <= 1.05 * wanted, (fetched, wanted)
    print(f"read-ahead {readahead}: {fetched / wanted:.2f}x the bytes read came from the device")


def test_open_files_stay_under_the_limit_and_a_descriptor_in_use_is_never_closed(tmp_path):
    """The reader's and the writer's descriptor cache (`reader.OpenFiles`): at most `max_open` open when none is in
    use, the least recently used closed first, one a thread is using kept open past the limit."""
    import os

    paths = []
    for i in range(5):
        paths.append(str(tmp_path / f"f{i}"))
        open(paths[-1], "wb").write(bytes([i]))
    opened = []
    files = OpenFiles(lambda p: opened.append(p) or os.open(p, os.O_RDONLY), max_open=2)
    with files.use(paths[0]) as held:
        for p in paths[1:4]:
            with files.use(p) as fd:
                assert os.pread(fd, 1, 0) == bytes([paths.index(p)])
        assert os.pread(held, 1, 0) == b"\x00"  # in use throughout: never closed
    with files.use(paths[4]):
        pass
    left = files.take_all()
    assert len(left) == 2 and [p for p, _ in left] == paths[3:5]  # the two most recently used
    for _, fd in left:
        os.close(fd)
    with files.use(paths[1]):  # closed earlier: opened again
        pass
    assert opened == paths + [paths[1]]
    for _, fd in files.take_all():
        os.close(fd)


def test_pickled_tensors_are_read_from_their_own_bytes_when_they_share_a_storage():
    """torch.save keeps views as views: a pickled checkpoint's tensors can start anywhere in a shared storage."""
    from hf_zero3_loader.checkpoint import TensorEntry
    from hf_zero3_loader.planner.plan import ReadItem
    from hf_zero3_loader.reader import ReadStats, execute_read, read_stored

    storage = torch.arange(40, dtype=torch.float32)
    tensor = storage[16:].view(4, 6)  # storage offset 16
    entry = TensorEntry(key="w", file="pytorch_model.bin", dtype=tensor.dtype, shape=(4, 6), data_start=0,
                        tensor=tensor)
    reader = FileReader(ReadStats())
    out = torch.empty(6)
    execute_read(reader, ReadItem("pytorch_model.bin", "w", tensor.dtype, 7, 2, 3, 6, 0), entry, out)
    assert torch.equal(out, torch.cat([tensor.reshape(-1)[7:10], tensor.reshape(-1)[13:16]]))
    stored = torch.empty(5, dtype=torch.int32)  # bytes unchanged, viewed as the reader's dtype of that item size
    read_stored(reader, entry, 3, stored)
    assert torch.equal(stored, tensor.reshape(-1)[3:8].view(torch.int32))


@pytest.mark.parametrize("change", ["renamed_over", "deleted", "written_in_place"])
def test_a_file_changed_while_its_descriptor_is_held_is_named_for_what_happened(tmp_path, change):
    """A file renamed over (or deleted) after this reader opened it keeps its inode on the open descriptor, but its
    link count drops to 0 and its change time moves: that is a replacement, not a write in place."""
    import os

    from hf_zero3_loader.checkpoint import FileIdentity
    from hf_zero3_loader.reader import checked_reads

    path = str(tmp_path / "model.safetensors")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 16)
    reader = FileReader(identities={path: FileIdentity.of(os.stat(path))})
    with pytest.raises(Exception) as caught:
        with checked_reads(reader):
            reader.read_into(path, 0, torch.empty(64, dtype=torch.uint8))
            if change == "renamed_over":
                with open(path + ".new", "wb") as f:
                    f.write(bytes(4096))
                os.replace(path + ".new", path)
            elif change == "deleted":
                os.remove(path)
            else:
                with open(path, "r+b") as f:
                    f.write(b"\x01")
            reader.read_into(path, 64, torch.empty(64, dtype=torch.uint8))
    what = "written in place" if change == "written_in_place" else "replaced"
    assert f"changed on disk while it was read ({what} during the load)" in str(caught.value)
