"""Where a save writes before it is published, and how it is published.

A save writes into a temporary folder beside its target (`.NAME.hf_zero3_tmp-TOKEN`), or inside the target where
the folder beside it cannot be made or renamed into it (the target is a mount point, or its parent is not writable).
Until the save is published, its weight files and index carry the `.partial` suffix: names transformers (and this
loader) never look for, so an unfinished save, whatever killed it, loads nowhere; `from_pretrained` of its folder
finds no weights and says so. Publishing renames them, and moves the folder (or its files) into place.

The writing rank holds an exclusive `flock` on the folder's writer file while it writes: a later save into the same
target removes the temporary folders whose lock it can take (their writer is gone: killed, its node lost), never one
whose writer still lives.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import time

from .checkpoint import INDEX_NAMES, SINGLE_NAMES, with_variant

TEMP_MARK = ".hf_zero3_tmp-"
WRITER_FILE = ".hf_zero3_writer"  # the folder's token; its writer holds a lock on it while the save runs
UNFINISHED = ".partial"  # the suffix of weight files and index until the save is published
# a temporary folder without its writer file is one whose writer died between making it and locking it (a few
# instructions), or that another save is making right now: it counts as stale once this old
UNLOCKED_STALE_S = 600


def unfinished(name: str) -> str:
    """The name a weight file or index has until the save is published."""
    return name + UNFINISHED


def _lock(fd: int) -> bool | None:
    """Take an exclusive lock without waiting: True, False (another process holds it), or None (this filesystem
    has no locks: Lustre without `-o flock`)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


def temp_folders_of(final: str) -> list[str]:
    """Every temporary folder a save into `final` may have left: beside it, or inside it."""
    parent, base = os.path.dirname(final), os.path.basename(final)
    found = []
    for folder, prefix in ((parent, f".{base}{TEMP_MARK}"), (final, TEMP_MARK)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found += [os.path.join(folder, n) for n in sorted(names) if n.startswith(prefix)
                  and os.path.isdir(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))]
    return found


def writer_gone(folder: str) -> bool:
    """Whether the save writing `folder` has ended without publishing it: its writer's lock is free (the process
    that held it is gone). Where locks cannot tell, no."""
    try:
        fd = os.open(os.path.join(folder, WRITER_FILE), os.O_RDONLY)
    except FileNotFoundError:
        try:
            return time.time() - os.stat(folder).st_mtime > UNLOCKED_STALE_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        return bool(_lock(fd))  # closing the descriptor releases the lock taken
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_stale(final: str) -> list[str]:
    """Remove the temporary folders of earlier saves into `final` whose writers are gone; returns them."""
    removed = []
    for folder in temp_folders_of(final):
        if writer_gone(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class TempFolder:
    """The writing rank's temporary folder for a save into `final`, made and locked by `create`."""

    def __init__(self, final: str):
        if os.path.isfile(final):
            from .errors import ConfigError

            raise ConfigError(f"{final} is a file; save_pretrained needs a folder")
        self.final = final
        # a new (or empty) folder is renamed into place whole; into a folder holding other files, files are moved
        self.into_existing = os.path.isdir(final) and bool(os.listdir(final))
        self.token = secrets.token_hex(8)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        beside = os.access(parent, os.W_OK | os.X_OK) and (
            not os.path.isdir(final) or os.stat(final).st_dev == os.stat(parent).st_dev)
        if beside or not os.path.isdir(final):
            self.path = os.path.join(parent, f".{os.path.basename(final)}{TEMP_MARK}{self.token}")
        else:  # a mount point, or a parent this process cannot write: a rename from beside could not land
            self.path = os.path.join(final, TEMP_MARK + self.token)
            self.into_existing = True  # its files are moved out of it, into the folder around it
        self.removed = remove_stale(final)
        self._lock_fd = None
        os.mkdir(self.path)
        fd = os.open(os.path.join(self.path, WRITER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _lock(fd)  # held until published or removed (a filesystem without locks: not held)
            os.write(fd, self.token.encode())
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def remove(self) -> None:
        """The save failed: the folder goes (then the lock, so no other save removes it half-way)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def publish(self, files: set[str], variant: str | None, remove_stale_shards: bool) -> None:
        """Move the finished files into place: the temporary folder renamed (its unfinished names first given their
        own), or its files moved one by one into the existing folder, which other files share (a Trainer's
        output_dir). There the earlier save's completion markers, its index and its single weights file, go first
        and the new one (the index, or the single weights file) comes last, so a process killed between two moves
        leaves a folder that fails to load (transformers: no weights file), never old and new shards mixed under
        one index. The earlier save's numbered shards that this one did not write go too (as transformers'
        save_pretrained removes them, `remove_stale_shards`)."""
        final, temp = self.final, self.path
        # the writer file stays until the end: a save killed while publishing leaves a folder the next one removes
        names = {n.removesuffix(UNFINISHED): n for n in os.listdir(temp) if n != WRITER_FILE}  # final name -> now
        index, single = with_variant(INDEX_NAMES[0], variant), with_variant(SINGLE_NAMES[0], variant)
        if not self.into_existing:
            for name, now in names.items():
                if now != name:
                    os.rename(os.path.join(temp, now), os.path.join(temp, name))
            if os.path.isdir(final) and not os.listdir(final):
                os.rmdir(final)
            os.rename(temp, final)
            os.remove(os.path.join(final, WRITER_FILE))
            self.release()
            return
        for marker in (index, single):  # an earlier save's: transformers would load it, or shadow the new shards
            if os.path.isfile(os.path.join(final, marker)):
                os.remove(os.path.join(final, marker))
        last = [n for n in ("config.json", index) if n in names]
        weights = sorted(n for n in names if n in files and n not in last)
        order = weights + sorted(n for n in names if n not in weights and n not in last) + last
        if len(files) == 1:  # the single weights file marks the checkpoint complete: it goes last
            order = [n for n in order if n not in files] + sorted(files)
        for name in order:
            target = os.path.join(final, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(temp, names[name]), target)
        if remove_stale_shards:
            _remove_stale_shards(final, files, variant)
        os.remove(os.path.join(temp, WRITER_FILE))
        os.rmdir(temp)
        self.release()


def is_index(name: str, variant: str | None) -> bool:
    return name in {*INDEX_NAMES, *(with_variant(n, variant) for n in INDEX_NAMES)}


def _remove_stale_shards(folder: str, written: set[str], variant: str | None) -> None:
    """What transformers' save_pretrained removes: numbered weight shards of an earlier save that this one did not
    write (`model-00003-of-00004.safetensors` after a save into fewer shards)."""
    weights_no_suffix = f"model.{variant}" if variant else "model"
    pattern = re.compile(r"(.*?)-\d{5}-of-\d{5}")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if (name.startswith(weights_no_suffix) and os.path.isfile(path) and name not in written
                and pattern.fullmatch(name.replace(".safetensors", "")) is not None):
            os.remove(path)
