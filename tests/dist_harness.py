"""Run a function on N real processes joined by a gloo process group; collect each rank's result.

Every wait is bounded: the process group has a collective timeout, and the parent kills every rank and fails
the test if the ranks do not all report within ``timeout_s``. A rank killed by a signal it did not send itself (a
native crash inside gloo or the allocator, no Python error to report) is rerun once from clean directories, with a
warning naming the rank and the signal; a second crash fails the test.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue as queue_module
import random
import runpy
import shutil
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Where :func:`free_port` picks: below Linux's ephemeral range (32768-60999, what outgoing connections' local
#: ports come from) and below torchrun's default 29500 and the SLURM tests' 29500-30500.
PORTS = range(20000, 29000)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a launcher or store that binds it a moment later. Picked at random
    from :data:`PORTS`: in between, an outgoing connection (a gloo pair, another test's store client) is never given
    it, and another test's pick rarely is. The OS's choice if none of the picks is free."""
    return first_free([*random.SystemRandom().sample(PORTS, 64), 0])


def first_free(ports: Iterable[int]) -> int:
    """The first of ``ports`` that 127.0.0.1 can bind now (0: the OS picks one)."""
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"no free TCP port on 127.0.0.1 among {ports}")


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any, args: tuple,
           collective_timeout_s: float, backend: str, environ: dict[str, str]) -> None:
    # A fork of the fork server holds the server's environment: take the test's, as a spawned rank would have.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.enable()  # a native crash prints this rank's Python stack to the test's captured stderr
    try:
        # the parent holds the store's listening socket (see _start): this rank only connects to it
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=collective_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s))
        result = fn(rank, world, *args)
        # Serialise to bytes: tensors sent as-is would travel as shared-memory handles that die with the rank.
        payload = io.BytesIO()
        torch.save(result, payload)
        queue.put((rank, "ok", payload.getvalue()))
        dist.barrier()
    except BaseException as err:  # report, never hang the parent
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Skip interpreter finalization (gloo threads holding Python objects can abort it); flush first.
        queue.close()
        queue.join_thread()
        os._exit(0)


def _context(backend: str) -> Any:
    """The ranks' start method: forks of one fork server per test session that has imported torch, arc_engine and
    the frameworks once (``tests/rank_preload.py``); each rank still gets the test's ``sys.path``, working directory
    and environment. On a machine with a CUDA device, and for NCCL, every rank is spawned from scratch (a fork of a
    process whose imports may have touched the driver is no place to start CUDA); ``ARC_TEST_START=spawn`` does the
    same anywhere."""
    method = os.environ.get("ARC_TEST_START", "forkserver")
    if backend != "gloo" or torch.cuda.is_available():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["tests.rank_preload"])
    return ctx


def _start(fn: Callable[..., Any], world: int, args: tuple, collective_timeout_s: float,
           backend: str = "gloo") -> tuple[list[Any], Any, Any]:
    """Start ``world`` ranks running ``fn`` through :func:`_entry`; their processes, the result queue and the
    rendezvous store. The parent binds the store on port 0 and keeps it open while the ranks run, so no other
    process can take the port between its choice and its use (a free port picked then bound later could be)."""
    ctx = _context(backend)
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=collective_timeout_s))
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store.port, queue, args, collective_timeout_s, backend,
                                                dict(os.environ)))
             for r in range(world)]
    for proc in procs:
        proc.start()
    return procs, queue, store


def _reap(procs: list[Any], grace_s: float) -> set[int]:
    """Join the ranks for at most ``grace_s`` in all, then kill whichever is still alive -- also when the wait is
    interrupted (pytest-timeout raising in the middle of it): a rank left behind would keep pytest from exiting.
    Returns the ranks it killed."""
    deadline = time.monotonic() + grace_s
    killed: set[int] = set()
    try:
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
                killed.add(rank)
    return killed


def _crashed(procs: list[Any], killed: set[int], reported: set[int]) -> dict[int, int]:
    """The ranks that died of a signal without reporting and without being killed here: ``{rank: signal}``."""
    return {rank: -proc.exitcode for rank, proc in enumerate(procs)
            if rank not in killed and rank not in reported and proc.exitcode is not None and proc.exitcode < 0}


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 180.0,
              collective_timeout_s: float = 60.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return results ordered by rank.
    ``backend``: the process group's (``nccl`` in the CUDA tests).

    Raises AssertionError naming the rank when any rank raised or the ranks did not finish in time.
    ``fn`` and ``args`` must be picklable (module-level function). A native crash of a rank (see the module's
    docstring) reruns the whole group once; the directories among ``args`` that the first run created are removed
    first, so the rerun starts from what the test gave.
    """
    fresh = [arg for arg in args if isinstance(arg, Path) and not arg.exists()]
    try:
        return _run_once(fn, world, args, timeout_s, collective_timeout_s, backend)
    except _NativeCrash as crash:
        warnings.warn(f"rerunning {getattr(fn, '__name__', fn)} once: {crash}", stacklevel=2)
        for path in fresh:
            shutil.rmtree(path, ignore_errors=True)
        return _run_once(fn, world, args, timeout_s, collective_timeout_s, backend, rerun=True)


class _NativeCrash(AssertionError):
    """A rank died of a signal it did not raise in Python."""


def _run_once(fn: Callable[..., Any], world: int, args: tuple, timeout_s: float, collective_timeout_s: float,
              backend: str, rerun: bool = False) -> list[Any]:
    procs, queue, _store = _start(fn, world, args, collective_timeout_s, backend)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, payload = queue.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue_module.Empty:
                silent = [proc for r, proc in enumerate(procs) if r not in results and r not in errors]
                if time.monotonic() >= deadline:
                    raise
                if all(proc.exitcode is not None for proc in silent):  # dead without a word: nothing will come
                    rank, status, payload = queue.get(timeout=2.0)  # (unless still in the pipe)
                else:
                    continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    except Exception as err:
        killed = _reap(procs, 30.0)
        crashed = _crashed(procs, killed, set(results) | set(errors))
        reported = "".join(f"\nrank {r} failed:\n{errors[r]}" for r in sorted(errors))  # what a hung peer hides
        message = (f"ranks did not all report within {timeout_s}s (got {sorted(results)}, errors {sorted(errors)}, "
                   f"killed after the wait {sorted(killed)}, died of a signal {crashed}): {err!r}{reported}")
        raise (_NativeCrash if crashed and not rerun else AssertionError)(message) from None
    finally:
        _reap(procs, 30.0)
    if errors:
        rank = min(errors)
        others = "".join(f"\nrank {r} also failed: {errors[r].splitlines()[0]}" for r in sorted(errors) if r != rank)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}{others}")
    return [results[r] for r in range(world)]


def run_ranks_to_exit(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 180.0,
                      collective_timeout_s: float = 60.0) -> list[int | None]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes that are expected to die (e.g. SIGKILL
    themselves); return their exit codes by rank (None: still running at ``timeout_s``, then killed)."""
    procs, _, _store = _start(fn, world, args, collective_timeout_s)
    codes: list[int | None] = []
    try:
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            codes.append(proc.exitcode)
    finally:
        _reap(procs, 0.0)
    return codes


def _script_entry(script: str, argv: list[str], cwd: str, environ: dict[str, str], log: str) -> None:
    """One rank of :func:`run_script`: ``script`` run as ``__main__`` with ``argv``, as ``python script argv`` under
    torchrun would, its output (the native one too) to ``log``; the process ends with the script's exit status."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    with open(log, "wb", buffering=0) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    faulthandler.enable()
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    # the platform's default start method, as in a fresh interpreter (a fork server's child inherits its own; a data
    # loader's workers with a local worker_init_fn cannot be pickled to it)
    mp.set_start_method(None, force=True)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # what python would print before exiting with 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class ScriptRun:
    """What :func:`run_script` returns: the launcher's exit status (0 when every rank exited 0, else 1, as
    torchrun's), each rank's exit status and the ranks' output, rank by rank."""

    returncode: int
    codes: list[int | None]
    output: str


def run_script(script: Path, args: list[str], nproc: int, cwd: Path, env: dict[str, str],
               timeout_s: float = 500.0, grace_s: float = 20.0) -> ScriptRun:
    """``torchrun --nproc-per-node nproc script args``, started as forks of the fork server that has imported the
    frameworks once (``tests/rank_preload.py``) instead of a launcher and ``nproc`` interpreters importing them
    anew (10-15 s of CPU each for a trainer's script). Each rank gets torchrun's environment (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``: the frameworks see an
    elastic launch) and rendezvouses on a store this process holds, as torchrun's agent does. When a rank fails the
    others get ``grace_s`` to end, then are stopped, as torchrun stops them; past ``timeout_s`` every rank is.
    Tests of what torchrun itself does (its exit status, its restarts) start the real one."""
    ctx = _context("gloo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    logs = [cwd / f".rank{rank}.{os.getpid()}.{store.port}.log" for rank in range(nproc)]
    procs = []
    for rank in range(nproc):
        environ = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                   "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "GROUP_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "TORCHELASTIC_RUN_ID": f"test-{store.port}", "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
        procs.append(ctx.Process(target=_script_entry, args=(str(script), list(args), str(cwd), environ,
                                                               str(logs[rank]))))
        procs[-1].start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.1)
    finally:
        stopped = {rank for rank, proc in enumerate(procs) if proc.is_alive()}
        for rank in stopped:
            procs[rank].terminate()  # SIGTERM, as torchrun's agent sends it
        _reap(procs, 10.0)
    output = ""
    for rank, log in enumerate(logs):
        text = log.read_text(errors="replace") if log.exists() else ""
        log.unlink(missing_ok=True)
        output += f"[rank {rank}] exit {procs[rank].exitcode}{' (stopped)' if rank in stopped else ''}\n{text}"
    codes = [proc.exitcode for proc in procs]
    return ScriptRun(0 if all(code == 0 for code in codes) else 1, codes, output)
