"""Whole-file sha256 digests of a checkpoint: the full check (`from_pretrained(..., verify_checkpoint="full")`) and the
`SHA256SUMS` manifest `hf-zero3-loader digest` writes.

By default ranks compare each file's size, header and a few sampled blocks (`checkpoint.FileFingerprint`), plus the
sha256 where it is known without reading the file (a hub cache blob name, a manifest). A full check hashes every
file whole, once per node: the node's ranks split the files between them, so each node reads its copy once, not once
per rank. Each digest is cached on the node, keyed by the file's identity (path, device, inode, size, modification
and change time), so the next load there reads nothing. The digests then stand in the fingerprints, and ranks compare
them before planning; a file whose hub cache blob name or manifest says another sha256 than its bytes is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from . import log
from .checkpoint import MANIFEST, FileFingerprint, FileIdentity
from .errors import CheckpointError, ConfigError

VERIFY_MODES = ("sampled", "full")
CACHE_ENV = "HF_ZERO3_LOADER_CACHE"
HASH_CHUNK_BYTES = 16 << 20
FULL_CHECK = "full check"


def check_mode(mode) -> None:
    if mode not in VERIFY_MODES:
        raise ConfigError(f"verify_checkpoint must be one of {VERIFY_MODES}, got {mode!r}")


def cache_folder() -> str:
    """Where this node keeps the digests it computed: `HF_ZERO3_LOADER_CACHE`, else `$XDG_CACHE_HOME/hf_zero3_loader`
    (`~/.cache/hf_zero3_loader`)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_zero3_loader")
    return os.path.join(root, "sha256")


def identity_key(identity: FileIdentity) -> str:
    """The file, as ranks on one node tell it apart (the same physical file has the same key on every rank there)."""
    return f"{identity.device}:{identity.inode}:{identity.size}:{identity.mtime_ns}:{identity.ctime_ns}"


def _cache_path(path: str) -> str:
    return os.path.join(cache_folder(), hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32] + ".json")


def cached_sha256(path: str, identity: FileIdentity) -> str | None:
    """The digest this node computed for `path` when it was the same file (same identity), else None."""
    try:
        with open(_cache_path(path)) as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    if entry.get("path") != os.path.realpath(path) or entry.get("identity") != identity_key(identity):
        return None
    return entry.get("sha256")


def remember_sha256(path: str, identity: FileIdentity, sha256: str) -> None:
    """Keep `sha256` for `path` on this node (written whole or not at all); a cache that cannot be written is
    skipped: the next full check hashes again."""
    target = _cache_path(path)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"path": os.path.realpath(path), "identity": identity_key(identity), "sha256": sha256}, f)
        os.replace(tmp, target)
    except OSError as e:
        log.debug("cannot cache the sha256 of %s in %s: %s", path, target, e)


def file_sha256(path: str, identity: FileIdentity | None = None) -> str:
    """The sha256 of the whole file, read through one descriptor; with `identity`, the file must be that one before
    and after it is read (a file written meanwhile is refused, naming it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint file {path}: {e.strerror}") from e
    try:
        if identity is not None and FileIdentity.of(os.fstat(fd)) != identity:
            raise CheckpointError(f"{path} changed on disk after its header was read (replaced or rewritten during "
                                  "the load); refusing to hash it")
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        h, buf = hashlib.sha256(), bytearray(HASH_CHUNK_BYTES)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])  # hashlib releases the GIL on large updates: files hash in parallel threads
        if identity is not None and FileIdentity.of(os.fstat(fd)) != identity:
            raise CheckpointError(f"{path} changed on disk while it was hashed (written during the load); refusing it")
        return h.hexdigest()
    finally:
        os.close(fd)


def sha256_of(path: str, identity: FileIdentity | None = None) -> str:
    """`file_sha256`, from this node's cache when it holds the same file."""
    identity = identity or FileIdentity.of(os.stat(path))
    known = cached_sha256(path, identity)
    if known is None:
        known = file_sha256(path, identity)
        remember_sha256(path, identity, known)
    return known


# -- the full check of a load -----------------------------------------------------------------------------------------

def split_over_ranks(files: dict[str, tuple[int, list[int]]]) -> dict[str, int]:
    """key -> the rank that hashes it, from key -> (size, ranks that hold it): the largest first, each to the least
    loaded rank holding it (the same answer on every rank of the node)."""
    load: dict[int, int] = {}
    owner = {}
    for key, (size, ranks) in sorted(files.items(), key=lambda kv: (-kv[1][0], kv[0])):
        rank = min(ranks, key=lambda r: (load.get(r, 0), r))
        owner[key] = rank
        load[rank] = load.get(rank, 0) + size
    return owner


def full_check(checkpoint, agreement, node: str, threads: int = 1) -> dict:
    """Every file's sha256 into `checkpoint.fingerprints` (this node's ranks splitting the files not cached on the node
    between them), each checked against what its hub cache blob name or manifest says. Every rank calls it at the
    same point; a rank without the files (streamed to) takes part with none. Returns {"hashed_bytes", "cached"}."""
    rank = agreement.rank
    by_key = {identity_key(identity): path for path, identity in checkpoint.identities.items()}
    digests = {}
    for key, path in by_key.items():
        known = cached_sha256(path, checkpoint.identities[path])
        if known is not None:
            digests[key] = known
    to_hash = {key: checkpoint.identities[path].size for key, path in by_key.items() if key not in digests}
    node_values = agreement.gather_node("find the checkpoint files to hash", node, {"rank": rank, "files": to_hash},
                                        needed=bool(to_hash))
    hashed = 0
    if node_values is not None:  # some rank, on some node, has files to hash
        holders: dict[str, tuple[int, list[int]]] = {}
        for value in node_values:
            for key, size in value["files"].items():
                holders.setdefault(key, (size, []))[1].append(value["rank"])
        mine = [key for key, owner in split_over_ranks(holders).items() if owner == rank]
        error, computed = None, {}
        try:
            def one(key):
                path = by_key[key]
                sha = file_sha256(path, checkpoint.identities[path])
                remember_sha256(path, checkpoint.identities[path], sha)
                return key, sha

            with ThreadPoolExecutor(max(1, threads), thread_name_prefix="hf_zero3_loader-hash") as pool:
                computed = dict(pool.map(one, mine))
            hashed = sum(checkpoint.identities[by_key[k]].size for k in mine)
        except Exception as e:
            error = e
        agreement.check("hash the checkpoint files", error)
        shared = agreement.gather_node("share the checkpoint files' digests", node, {"digests": computed},
                                       needed=True)
        for value in shared or []:
            digests.update((k, v) for k, v in value["digests"].items() if k in by_key)
    cached = len(by_key) - len(to_hash)
    for path, identity in checkpoint.identities.items():
        name = os.path.basename(path)
        fingerprint, sha = checkpoint.fingerprints.get(name), digests.get(identity_key(identity))
        if not isinstance(fingerprint, FileFingerprint):
            continue
        if sha is None:
            raise CheckpointError(f"internal error: no rank of this node hashed {path}")
        if fingerprint.sha256 is not None and fingerprint.sha256 != sha:
            raise CheckpointError(
                f"{path} does not hold what its {fingerprint.sha256_from} says: its bytes hash to sha256 {sha[:16]}..., "
                f"not {fingerprint.sha256[:16]}... (a damaged or changed copy); download or copy it again")
        checkpoint.fingerprints[name] = replace(fingerprint, sha256=sha, sha256_from=FULL_CHECK)
    return {"hashed_bytes": hashed, "cached_files": cached}


# -- the manifest ------------------------------------------------------------------------------------------------------

def write_manifest(folder: str, threads: int = 4) -> tuple[str, dict[str, str]]:
    """Hash every regular file of `folder` (not its subfolders) and write their sha256s as `SHA256SUMS`
    (`sha256sum -c SHA256SUMS` checks them). Loads of the folder then compare these digests across ranks. Returns
    (the manifest's path, {file name: sha256})."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"no such folder: {folder}")
    names = sorted(n for n in os.listdir(folder) if n != MANIFEST and not n.startswith(".")
                   and os.path.isfile(os.path.join(folder, n)))
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="hf_zero3_loader-hash") as pool:
        sums = dict(zip(names, pool.map(lambda n: sha256_of(os.path.join(folder, n)), names)))
    path = os.path.join(folder, MANIFEST)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(f"{sha}  {name}\n" for name, sha in sums.items())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path, sums
