"""Failure agreement and liveness: an error on any rank becomes the same error on every rank, and a dead or stopped
rank is noticed within seconds while a slow but live one is waited for.

Ranks meet at agreement points through the process group's key-value store (no collective, no process group of
its own): each rank counts itself in, a failing rank records its error (the first one wins), the last rank in opens
the gate, and every rank raises the first failing rank's exception type and message, prefixed with that rank.
Values ranks must share (the checkpoint's fingerprint) are compared at a point the same way: the first rank's value
is the reference, a rank whose value differs records the difference as the error.

Liveness, not skew: while a load runs, every rank's `_Heartbeat` thread writes its alive counter to the store every
second. Rank 0's thread watches every rank, the others watch rank 0; a rank whose counter stops for
`liveness_timeout_s` (a SIGSTOPped process, a lost machine) gets a verdict that every waiting rank raises. A killed
process is seen within a heartbeat period: each rank holds a TCP connection to rank 0 while a load runs, which the
kernel closes when the process ends (`_Sentinel`). A peer that has not started this load yet is waited for up to
`join_timeout_s`. Loads are numbered per process and every rank starts one at the same place, so a failed load
cannot pair with a retry; a peer in an earlier load is "not started yet".

Collectives of ours (missing-key init, the tied-weights check) run inside `collective_section`: entered only after
an agreement point (no rank enters a collective another rank will never join), with the process groups' timeout
lowered to the liveness bound, so a peer that stops inside one fails the section instead of hanging it. Gloo's
point-to-point waits ignore that timeout (a receiver whose sender stopped would wait out the group's 30 minutes),
so streams run in a thread that this one watches for the verdict (`run_watched`).

Private torch API (torch 2.13), through `_deepspeed_private.py` (its torch.distributed section): the default group's
store, and each group's collective timeout (`distributed_c10d._set_pg_timeout`; the gloo backend's `options._timeout`,
to restore it).
"""

from __future__ import annotations

import builtins
import datetime
import hashlib
import itertools
import json
import math
import os
import resource
import select
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from . import _deepspeed_private as ds_private
from . import errors, log

DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_LIVENESS_TIMEOUT_S = 30.0
JOIN_ENV = "HF_ZERO3_LOADER_TIMEOUT"
LIVENESS_ENV = "HF_ZERO3_LOADER_LIVENESS_TIMEOUT"
_ALIVE = "hf_zero3_loader/alive"


class AgreedFailure(Exception):
    """Marker base: this exception was already agreed on by all ranks, do not agree again."""


_rebuilt_types: dict[type, type] = {}


def _agreed_type(exc_type: type) -> type:
    """A subclass of the original type that also carries the AgreedFailure marker."""
    if exc_type not in _rebuilt_types:
        try:
            _rebuilt_types[exc_type] = type(exc_type.__name__, (exc_type, AgreedFailure), {"__module__": exc_type.__module__})
        except TypeError:
            _rebuilt_types[exc_type] = type("DistributedLoadError", (errors.DistributedLoadError, AgreedFailure), {})
    return _rebuilt_types[exc_type]


def _lookup(module: str, qualname: str) -> type:
    """Resolve an exception type by name; builtins and our errors are rebuilt as themselves."""
    candidates = {"builtins": builtins, errors.__name__: errors}
    owner = candidates.get(module)
    exc_type = getattr(owner, qualname, None) if owner else None
    if not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
        exc_type = errors.DistributedLoadError
    return exc_type


def _agreed(exc_type: type, message: str, cause: BaseException | None = None) -> BaseException:
    try:
        agreed = _agreed_type(exc_type)(message)
    except Exception:  # a type whose constructor wants more than a message
        agreed = _agreed_type(errors.DistributedLoadError)(f"{exc_type.__name__}: {message}")
    agreed.__cause__ = cause
    return agreed


def resolve_timeout(value, env: str, default: float, what: str) -> float:
    """A timeout in seconds: the argument, else the environment variable (read now, not at import), else the
    default. Must be a positive number (`float('inf')`: wait forever); anything else is a ConfigError."""
    source = f"{what}={value!r}"
    if value is None:
        raw = os.environ.get(env)
        if raw is None:
            return default
        source = f"{env}={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            raise errors.ConfigError(f"{source} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise errors.ConfigError(f"{source}: a timeout must be a positive number of seconds (float('inf') waits "
                                 "forever)")
    return float(value)


@dataclass(slots=True)
class _Peer:
    """One sentinel connection as its reader knows it."""
    rank: int | None  # rank 0's side: None until the hello names it
    counted: bool = False  # rank 0: the hello was taken; the other rank: rank 0's "k" arrived
    bye: bool = False
    refused: bool = False  # rank 0 over its descriptor budget: closed uncounted
    buffer: str = ""


class _Sentinel:
    """A TCP connection between rank 0 and each other rank, held while a load or save runs. The kernel closes a
    process's connections when it ends, killed or not, so a rank whose process is gone is seen within a heartbeat
    period, not after the liveness bound. A stopped process or a machine that lost power or network closes nothing:
    the liveness bound finds those, and it alone watches a rank that cannot reach rank 0 this way.

    The protocol leaves nothing to timing: the other rank connects as soon as rank 0 has said where it listens (at
    the latest when the first agreement point completes, before any read) and sends "LOAD:RANK"; rank 0 counts it in
    on that line and answers "k"; each side sends "bye" before it closes on a normal end; neither waits for the
    other. A connection that ends without a "bye" after its "LOAD:RANK" (seen by rank 0) or after the "k" (seen by
    the other rank) is a process that is gone; one that carries another load's number, or ends before the "k" on
    the other rank's side (rank 0 had left the load), is dropped unseen. Linux hands over a peer's last bytes
    before reporting a reset, so a "bye" is never lost to one."""

    BYE = "bye"

    def __init__(self, agreement: "Agreement"):
        self.a = agreement
        self.lock = threading.Lock()
        self.closed = False
        self.conns: dict[socket.socket, _Peer] = {}
        self.counted = 0  # rank 0: connections counted in
        self.listener = None
        self.connecting = threading.Lock()  # one connection attempt at a time (heartbeat or first agreement point)
        self.connect_done = False
        # rank 0 keeps at most half its descriptor limit for these, so the reads' own descriptors stay available
        self.capacity = max(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2 - 64)
        if agreement.rank == 0:
            try:
                self.listener = socket.create_server(("", 0), backlog=min(agreement.world_size, 4096))
                self.listener.setblocking(False)
                port = self.listener.getsockname()[1]
                agreement.store.set(f"{agreement.prefix}/sentinel", json.dumps([[h, port] for h in _own_addresses()]))
            except OSError as e:
                log.debug("no connection to watch the ranks by (%s); the liveness bound watches them", e)
                self.listener = None

    def watch(self) -> str | None:
        """A verdict if a watched rank's process is gone, else None (called from the heartbeat thread)."""
        self.connect()
        with self.lock:
            if self.closed:
                return None
            if self.listener is not None:
                self._accept()
            gone = sorted(self._read())
        if not gone:
            return None
        if len(gone) == 1:
            return f"rank {gone[0]}'s process is gone (its connection to rank {self.a.rank} closed without a goodbye)"
        return (f"the processes of ranks {', '.join(map(str, gone))} are gone (their connections to rank "
                f"{self.a.rank} closed without a goodbye)")

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # BlockingIOError: none waiting
                return
            sock.setblocking(False)
            self.conns[sock] = _Peer(rank=None)

    def _read(self) -> list[int]:
        """Read what every connection has sent, without waiting; the ranks whose processes are gone."""
        if not self.conns:
            return []
        poll = select.poll()  # not select(): descriptors past 1024 at thousands of ranks
        by_fd = {sock.fileno(): sock for sock in self.conns}
        for fd in by_fd:
            poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        gone = []
        for fd, _ in poll.poll(0):
            sock, peer = by_fd[fd], self.conns[by_fd[fd]]
            ended = False
            try:
                data = sock.recv(4096)
                ended = not data
            except BlockingIOError:
                data = b""
            except OSError:  # reset: the bytes before it were read by earlier calls
                ended = True
                data = b""
            peer.buffer += data.decode(errors="replace")
            *lines, peer.buffer = peer.buffer.split("\n")
            for line in lines:
                self._take(sock, peer, line.strip())
            if ended or peer.refused:
                if ended and peer.counted and not peer.bye:
                    gone.append(peer.rank)
                if peer.counted and self.a.rank == 0:
                    self.counted -= 1
                del self.conns[sock]
                sock.close()
        return gone

    def _take(self, sock: socket.socket, peer: _Peer, line: str) -> None:
        if line == self.BYE:
            peer.bye = True
        elif line == "k" and self.a.rank != 0:  # rank 0 of this load counted this rank in
            peer.counted = True
        elif self.a.rank == 0 and peer.rank is None:
            try:
                load_no, rank = (int(x) for x in line.split(":"))
            except ValueError:
                return
            if load_no != self.a.load_no or not 0 < rank < self.a.world_size or peer.bye:
                return  # another load's, or already leaving: never counted, dropped unseen when it ends
            if self.counted >= self.capacity:  # closed uncounted: the liveness bound alone watches that rank
                peer.refused = True
                return
            peer.rank, peer.counted = rank, True  # before answering: a hello then death is a death
            self.counted += 1
            try:
                sock.sendall(b"k\n")
            except OSError:  # it is gone already: the read that follows ends the connection
                pass

    def connect(self) -> None:
        """A rank other than 0 connects once rank 0 has said where it listens: from the heartbeat thread as soon as
        it has, and at the latest when the first agreement point completes (rank 0 said it before arriving there), so
        a rank killed as its reads begin is already connected. Never waits for another attempt in progress."""
        if self.a.rank == 0 or self.connect_done or not self.connecting.acquire(blocking=False):
            return
        try:
            if self.connect_done or self.closed:
                return
            sock = self._connect()  # outside `lock`: `close` never waits on a connection being made
            if sock is False:  # rank 0 has not said where yet: a later call tries again
                return
            self.connect_done = True
            if sock is not None:
                with self.lock:
                    if self.closed:
                        _say_bye_and_close(sock, self.BYE)
                    else:
                        self.conns[sock] = _Peer(rank=0)
        finally:
            self.connecting.release()

    def _connect(self):
        """This rank's connection to rank 0 (its hello sent); False while rank 0 has not said where it listens, None
        if no address of rank 0's answers (the liveness bound alone then watches)."""
        key = f"{self.a.prefix}/sentinel"
        if not self.a.store.check([key]):
            return False
        for host, port in json.loads(self.a.store.get(key)):
            try:
                sock = socket.create_connection((host, port), timeout=1.0)
                sock.sendall(f"{self.a.load_no}:{self.a.rank}\n".encode())
            except OSError:
                continue
            sock.setblocking(False)
            return sock
        return None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for sock in self.conns:
                _say_bye_and_close(sock, self.BYE)
            self.conns.clear()
            if self.listener is not None:
                self.listener.close()


def _say_bye_and_close(sock: socket.socket, bye: str) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(0.5)
        sock.sendall(f"{bye}\n".encode())
        sock.setblocking(False)
        while sock.recv(4096):  # unread bytes would turn the close into a reset
            pass
    except OSError:
        pass
    sock.close()


def _own_addresses() -> list[str]:
    """Addresses other ranks may reach this machine at: the launcher's MASTER_ADDR (rank 0 runs on the first node),
    then this host's own name and address."""
    out = []
    for host in (os.environ.get("MASTER_ADDR"), socket.gethostname()):
        if host and host not in out:
            out.append(host)
    try:
        address = socket.gethostbyname(socket.gethostname())
        if address not in out:
            out.append(address)
    except OSError:
        pass
    return out


class _Heartbeat(threading.Thread):
    """Writes this rank's alive counter; rank 0 watches every rank, the others watch rank 0; a verdict is written
    to the store when a watched rank is silent too long or never starts this load."""

    def __init__(self, agreement: "Agreement"):
        super().__init__(name="hf_zero3_loader-heartbeat", daemon=True)
        self.a = agreement
        self.period = min(1.0, agreement.liveness_s / 5)
        self.stopped = threading.Event()
        self.started_at = time.monotonic()
        self.seen: dict[int, tuple[str, float]] = {}  # rank -> (last value, when it last changed)
        self.sentinel = _Sentinel(agreement)  # a rank whose process ends is seen at once

    def run(self):
        a, seq = self.a, 0
        watched = [r for r in range(a.world_size) if r != a.rank] if a.rank == 0 else [0]
        while not self.stopped.is_set():
            try:
                a.store.set(f"{_ALIVE}/{a.rank}", f"{a.load_no}:{seq}")
                seq += 1
                verdict = self._watch_sentinel() or self._watch(watched)
                if verdict:
                    a.store.compare_set(f"{a.prefix}/verdict", "", verdict)
            except Exception:  # the store went away: the waiting side reports it
                pass
            self.stopped.wait(self.period)

    def _watch_sentinel(self) -> str | None:
        try:
            return self.sentinel.watch()
        except Exception as e:  # the heartbeat goes on: the liveness bound still watches
            log.debug("watching the ranks' connections failed (%s); the liveness bound watches them", e)
            return None

    def _watch(self, ranks: list[int]) -> str | None:
        a, now = self.a, time.monotonic()
        for r in ranks:
            key = f"{_ALIVE}/{r}"
            value = a.store.get(key).decode() if a.store.check([key]) else None
            load_no = int(value.split(":")[0]) if value else -1
            if load_no < a.load_no:  # has not started this load yet
                if now - self.started_at > a.join_timeout_s:
                    return (f"rank {r} did not start this load or save within {a.join_timeout_s:.0f}s (loading "
                            "and saving a ZeRO-3 model are collective: every rank must call them; a rank given "
                            "another DeepSpeed config, or none, loads without ZeRO-3 and never joins)")
                continue
            last = self.seen.get(r)
            if last is None or last[0] != value:
                self.seen[r] = (value, now)
            elif load_no == a.load_no and now - last[1] > a.liveness_s:
                return f"rank {r} stopped answering (no sign of life for {a.liveness_s:.0f}s)"
        return None


_loads = itertools.count()  # every rank starts its loads at the same place, so the numbers agree


class Agreement:
    def __init__(self, join_timeout_s: float | None = None, liveness_timeout_s: float | None = None):
        self.join_timeout_s = resolve_timeout(join_timeout_s, JOIN_ENV, DEFAULT_JOIN_TIMEOUT_S, "agreement_timeout_s")
        self.liveness_s = resolve_timeout(liveness_timeout_s, LIVENESS_ENV, DEFAULT_LIVENESS_TIMEOUT_S,
                                          "liveness_timeout_s")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.store = ds_private.default_store()
        self.load_no = next(_loads)
        self.prefix = f"hf_zero3_loader/load{self.load_no}"
        self.points = itertools.count()
        self._heartbeat = _Heartbeat(self) if self.world_size > 1 else None
        if self._heartbeat is not None:
            self._heartbeat.start()

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
            self._heartbeat.sentinel.close()

    def _lost(self, phase: str, detail: str, cause=None) -> BaseException:
        """The verdict as every rank raises it: with the phase of the first rank that raised it (a killed peer is
        reported within a second, while the others may still be one phase apart)."""
        try:
            phase = self.store.compare_set(f"{self.prefix}/verdict_phase", "", phase).decode()
        except Exception:  # the store is gone: this rank's own phase
            pass
        return _agreed(errors.DistributedLoadError, f"{detail} during '{phase}'", cause)

    def _wait(self, key: str, phase: str) -> None:
        """Until `key` exists; a verdict (dead or absent peer) or a lost store raises instead.

        Polled, not `store.wait`ed: a timed-out wait logs two C++ warnings each time. The delay grows by half, not
        doubling, so a rank oversleeps a peer's arrival by at most half its wait and at most the cap (doubling cost
        0.2-0.3 s on a 0.1 s plan skew). The cap grows with the world: from 500 ranks on, rank 0's store sees at
        most 5 polls (two checks each) per waiting rank per second."""
        delay, cap = 0.001, min(0.2, max(0.01, self.world_size / 2500))
        started, note_at = time.monotonic(), self.liveness_s
        while True:
            if self.store.check([key]):
                if self._heartbeat is not None:  # every rank was here, rank 0 too: it has said where it listens
                    self._heartbeat.sentinel.connect()
                return
            if self.store.check([f"{self.prefix}/verdict"]):
                raise self._lost(phase, self.store.get(f"{self.prefix}/verdict").decode())
            time.sleep(delay)
            delay = min(delay * 1.5, cap)
            waited = time.monotonic() - started
            if waited >= note_at:  # a long wait says where it is, as progress would: hangs are then readable
                self._note_waiting(key.rsplit("/", 1)[0], phase, waited)
                note_at += 2 * self.liveness_s

    def _note_waiting(self, point: str, phase: str, waited: float) -> None:
        arrived = int(self.store.add(f"{point}/arrived", 0))
        not_started = []
        if self.rank == 0:  # its heartbeat watches every rank: name those that have not started this load
            for r in range(1, self.world_size):
                value = self.store.get(f"{_ALIVE}/{r}").decode() if self.store.check([f"{_ALIVE}/{r}"]) else ""
                if int(value.split(":")[0] if value else -1) < self.load_no:
                    not_started.append(r)
        # rank 0 says it (every rank at 512 ranks would be 500 lines a minute); the others at debug level
        (log.warning if self.rank == 0 else log.debug)(
            "rank %d has waited %.0fs at '%s' for the other ranks (%d of %d are there)%s. A rank that is alive is "
            "waited for; one that stops answering for %.0fs fails the load on every rank (liveness_timeout_s).",
            self.rank, waited, phase, arrived, self.world_size,
            f"; not started this load yet: ranks {', '.join(map(str, not_started[:8]))}"
            f"{' and more' if len(not_started) > 8 else ''} (waited for up to {self.join_timeout_s:.0f}s: "
            "loading and saving are collective, every rank must call them)" if not_started else "",
            self.liveness_s)

    def check(self, phase: str, error: BaseException | None = None, same: dict | None = None,
              differs: str = "are not loading the same checkpoint", error_type: type = errors.CheckpointError,
              hint: str | None = None, hints: dict[str, str] | None = None, same_where_known: dict | None = None,
              explain=None) -> None:
        """Every rank calls this at the same points; raise on every rank if `error` is set on any rank, or if
        `same` (label -> value) differs from the first rank's (then `error_type`: "ranks A and B {differs}: ...",
        ending with what to do: `hints[label]`, else `hint`). `same_where_known`: values only some ranks know (a
        file's sha256), compared among the ranks that pass them, against the first of them. `explain(label, theirs,
        mine, their_rank, my_rank)` may say how two values differ (else both are shown)."""
        if isinstance(error, AgreedFailure):
            raise error
        key = f"{self.prefix}/point{next(self.points)}"
        try:
            if error is None and same is not None:
                error = self._compare(key, same, differs, error_type, hint, hints or {}, same_where_known, explain)
            if error is not None:
                payload = json.dumps([self.rank, type(error).__module__, type(error).__qualname__, str(error)])
                self.store.compare_set(f"{key}/error", "", payload)  # the first failure wins
            if self.store.add(f"{key}/arrived", 1) == self.world_size:
                self.store.set(f"{key}/done", "1")
            self._wait(f"{key}/done", phase)
            failed = self.store.check([f"{key}/error"])
            first = json.loads(self.store.get(f"{key}/error")) if failed else None
        except AgreedFailure:
            raise
        except Exception as e:  # the store is gone: the rank hosting it died
            raise _store_lost(e) from e
        if first is None:
            return
        rank, module, qualname, message = first
        raise _agreed(_lookup(module, qualname), f"[rank {rank}] {message}", error)

    def _arrive(self, key: str, phase: str, needed: bool) -> None:
        """This rank's value is published at `key`: count it (and whether it asks for every value), then wait until
        every rank has."""
        if needed:
            self.store.add(f"{key}/needed", 1)
        if self.store.add(f"{key}/arrived", 1) == self.world_size:
            self.store.set(f"{key}/done", "1")
        self._wait(f"{key}/done", phase)

    def gather(self, phase: str, value: dict, needed: bool) -> list[dict] | None:
        """Every rank publishes `value` (JSON); when any rank says `needed`, every rank gets all ranks' values (one
        batched store read), else None: the common case costs one store round trip, whatever the world size."""
        key = f"{self.prefix}/point{next(self.points)}"
        try:
            self.store.set(f"{key}/value/{self.rank}", json.dumps(value))
            self._arrive(key, phase, needed)
            if not self.store.add(f"{key}/needed", 0):
                return None
            raw = self.store.multi_get([f"{key}/value/{r}" for r in range(self.world_size)])
        except AgreedFailure:
            raise
        except Exception as e:
            raise _store_lost(e) from e
        return [json.loads(v) for v in raw]

    def gather_node(self, phase: str, node: str, value: dict, needed: bool) -> list[dict] | None:
        """Every rank publishes `value` (JSON); when any rank says `needed`, each rank gets the values of the ranks on
        its own `node` (ranks sharing storage: the work of a node split between them), else None. A rank that fails
        instead, at this point (`check` with its error), fails every rank here."""
        key = f"{self.prefix}/point{next(self.points)}"
        group = f"{key}/node/{digest(node)}"
        try:
            slot = int(self.store.add(f"{group}/count", 1)) - 1
            self.store.set(f"{group}/{slot}", json.dumps(value))
            self._arrive(key, phase, needed)
            if self.store.check([f"{key}/error"]):
                rank, module, qualname, message = json.loads(self.store.get(f"{key}/error"))
                raise _agreed(_lookup(module, qualname), f"[rank {rank}] {message}")
            if not self.store.add(f"{key}/needed", 0):
                return None
            count = int(self.store.add(f"{group}/count", 0))
            raw = self.store.multi_get([f"{group}/{i}" for i in range(count)])
        except AgreedFailure:
            raise
        except Exception as e:
            raise _store_lost(e) from e
        return [json.loads(v) for v in raw]

    def share(self, name: str, value=None):
        """Values one rank computes and the others read, through the store: the owner calls `share(name, value)`
        before an agreement point, the others `share(name)` after it."""
        key = f"{self.prefix}/shared/{name}"
        try:
            if value is not None:
                self.store.set(key, json.dumps(value))
                return value
            return json.loads(self.store.get(key))
        except Exception as e:
            raise _store_lost(e) from e

    def _compare(self, key: str, same: dict, differs: str, error_type: type, hint: str | None,
                 hints: dict, known: dict | None = None, explain=None) -> BaseException | None:
        for reference_key, values in (("reference", same), ("reference_known", known)):
            if not values:
                continue
            mine = {"rank": self.rank, "values": values}
            reference = json.loads(self.store.compare_set(f"{key}/{reference_key}", "", json.dumps(mine)).decode())
            if reference["rank"] == self.rank:
                continue
            theirs, other = reference["values"], reference["rank"]
            for label in list(theirs) + [k for k in values if k not in theirs]:
                if theirs.get(label) == values.get(label):
                    continue
                how = explain(label, theirs.get(label), values.get(label), other, self.rank) if explain else None
                how = how or (f"{_short(theirs.get(label))} on rank {other}, {_short(values.get(label))} on rank "
                              f"{self.rank}")
                return error_type(f"ranks {other} and {self.rank} {differs}: {label} differs ({how})"
                                  + (f"; {hints.get(label, hint)}" if hints.get(label, hint) else ""))
        return None

    @contextmanager
    def collective_section(self, phase: str, groups=()):
        """Agree first, then run collectives (or point-to-point transfers) with the groups' timeout lowered to the
        liveness bound. A failure inside is agreed on at once: a live rank's own error reaches every rank, a rank
        that died or stopped inside shows as its liveness verdict, and nobody waits out a transport timeout."""
        self.check(f"before {phase}")
        if self.world_size == 1:
            yield
            return
        restore = _lower_timeouts([None, *groups], self.liveness_s + 5)
        error = None
        try:
            yield
        except AgreedFailure:
            raise
        except Exception as e:
            error = e
        finally:
            restore()
        if error is None:
            return
        # a peer that failed on its own reports its error at this same point: do not race it with ours
        self.check(phase, None if isinstance(error, errors.PeerFailed) else error)
        raise _agreed(errors.DistributedLoadError, f"[rank {self.rank}] {phase} failed: {error}", error)

    def run_watched(self, transfer, phase: str, cancel: threading.Event):
        """Run `transfer` (point-to-point sends and receives) in a thread, and wait for it here, watching for a
        verdict: a peer that stops mid-stream fails the load within the liveness bound, where the transfer itself
        would wait on; a slow but live one is waited for. On a verdict or an interrupt, `cancel` is set (the transfer
        stops at its next chunk, if its wait ever ends) and the thread is left behind: the load has failed."""
        thread = Worker(transfer, "hf_zero3_loader-stream")
        thread.start()
        period, key = min(1.0, self.liveness_s / 5), f"{self.prefix}/verdict"  # the heartbeat's period
        try:
            while True:
                thread.join(period)
                if not thread.is_alive():
                    break
                try:
                    verdict = self.store.get(key).decode() if self.store.check([key]) else None
                except Exception as e:
                    raise _store_lost(e) from e
                if verdict:
                    raise self._lost(phase, verdict)
        except BaseException:
            cancel.set()
            raise
        if thread.error is not None:
            raise thread.error


class Worker(threading.Thread):
    """`work()` in a daemon thread; its exception, if any, is kept for whoever joins it (`error`)."""

    def __init__(self, work, name: str):
        super().__init__(name=name, daemon=True)
        self.work, self.error = work, None

    def run(self):
        try:
            self.work()
        except BaseException as e:
            self.error = e


def digest(value) -> str:
    """A short digest of a JSON-able value (dict keys in any order), for ranks to compare what they hold."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _store_lost(cause: BaseException) -> BaseException:
    """The same message on every rank that sees it (the detail differs by rank; it stays in the cause)."""
    return _agreed(errors.DistributedLoadError, "the process group's store stopped answering: the launcher or rank "
                   "hosting it (on rank 0's node) is gone, or its node lost the network", cause)


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _lower_timeouts(groups, seconds: float):
    """Set each process group's collective timeout to `seconds`; return a function restoring the old ones."""
    saved = []
    for group in groups:
        pg = group if group is not None else ds_private.default_process_group()
        try:
            old = ds_private.cpu_backend_timeout(pg)
        except Exception:  # NCCL / unknown backends: leave them to their own watchdog
            continue
        saved.append((pg, old))
        ds_private.set_process_group_timeout(datetime.timedelta(seconds=seconds), pg)

    def restore():
        for pg, old in saved:
            try:
                ds_private.set_process_group_timeout(old, pg)
            except Exception:
                pass

    return restore
