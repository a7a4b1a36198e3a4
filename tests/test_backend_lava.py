"""The lava backend's worker never outlives its run: Ctrl-C, SIGTERM, a timeout or the death of
the calling process stop the worker's whole process group, and its shared memory and temporary
files go with it. With a stand-in worker (multiprocessing children and a shared memory segment,
as Lava's runtime makes), and with Lava itself where the side environment exists."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from snnconv.errors import BackendError
from snnconv_backends.lava import _check, lava_python, run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A stand-in for the Lava worker: three forked children and a shared memory segment; it
#: writes the children's pids and the segment's name to argv[1], then optionally interrupts its
#: parent (as Ctrl-C would) and sleeps. With "unregistered", the segment is not known to the
#: resource tracker (as when a process is stopped between creating a segment and registering it).
FAKE_WORKER = """
import multiprocessing as mp, os, signal, sys, time
from multiprocessing import resource_tracker, shared_memory

def child():
    time.sleep(600)

if __name__ == "__main__":
    mp.set_start_method("fork")
    shm = shared_memory.SharedMemory(create=True, size=1 << 16)
    if sys.argv[2] == "unregistered":
        resource_tracker.unregister(shm._name, "shared_memory")
    kids = [mp.Process(target=child) for _ in range(3)]
    for k in kids:
        k.start()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(" ".join(str(k.pid) for k in kids) + "\\n" + shm.name)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    if sys.argv[2] == "interrupt":
        os.kill(os.getppid(), signal.SIGINT)
    time.sleep(600)
"""


def _procs():
    """``(pid, state, ppid, pgid)`` of every process (from /proc)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid, pgid = f.read().rsplit(")", 1)[1].split()[:3]
            except OSError:
                continue
            yield int(entry), state, int(ppid), int(pgid)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    return any(p == pid and state != "Z" for p, state, _, _ in _procs())


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    return [p for p, state, _, g in _procs() if g == pgid and state != "Z"]


def _children(pid: int) -> list[int]:
    return [p for p, _, ppid, _ in _procs() if ppid == pid]


def _shared_memory(pids: list[int]) -> set[str]:
    """The /dev/shm files that processes ``pids`` have mapped."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {line.split()[-1] for line in f if "/dev/shm/" in line}
        except OSError:
            pass
    return found


#: Seconds before a run that never starts fails the test (a guard against a hang, not a bound
#: on anything measured).
HANG = 600.0


def _fake(tmp_path, mode: str) -> list[str]:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return [sys.executable, str(script), str(tmp_path / "started"), mode]


def _started(tmp_path) -> tuple[list[int], str]:
    pids, name = (tmp_path / "started").read_text().splitlines()
    return [int(p) for p in pids.split()], name


def _sigint_as_keyboard_interrupt():
    """Restore Python's Ctrl-C handler in a child: a shell starts background jobs (as a CI
    runner may run the suite) with SIGINT ignored, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_run_stops_the_worker_group_and_frees_its_shared_memory(tmp_path):
    # the suite may run with SIGINT ignored (a background job): Ctrl-C must still arrive here
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_worker(_fake(tmp_path, "interrupt"), str(tmp_path), timeout=600)
    finally:
        signal.signal(signal.SIGINT, previous)
    kids, shm = _started(tmp_path)
    assert not any(_alive(p) for p in kids)
    assert not os.path.exists(f"/dev/shm/{shm}")


@pytest.mark.parametrize("mode", ["sleep", "unregistered"])
def test_a_run_past_its_timeout_is_stopped_and_refused(tmp_path, mode):
    cmd = _fake(tmp_path, mode)
    with pytest.raises(BackendError, match="took more than 3 s"):
        run_worker(cmd, str(tmp_path), timeout=3)  # the stand-in never ends by itself
    kids, shm = _started(tmp_path)
    assert not any(_alive(p) for p in kids)
    assert not os.path.exists(f"/dev/shm/{shm}")


def test_the_worker_s_exit_code_and_stderr_come_back(tmp_path):
    code, err = run_worker([sys.executable, "-c", "import sys; sys.stderr.write('bad job'); sys.exit(3)"],
                           str(tmp_path), timeout=600)
    assert (code, err) == (3, "bad job")


# --- with Lava itself -----------------------------------------------------------------------

needs_lava = pytest.mark.skipif(not _check(lava_python())[0], reason="no Lava side environment "
                                "(make lava-env, or SNNCONV_LAVA_PYTHON)")


@needs_lava
@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "terminated"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_snnconv_run_on_lava_interrupted_leaves_no_process_and_no_file(small_digits_snn, tmp_path,
                                                                        request, sig, code, said):
    from snnconv.snn.nir_io import export_nir, save_nir

    path = tmp_path / "snn.nir"
    save_nir(export_nir(small_digits_snn), path)
    # a short TMPDIR: Lava's sockets live in it, and a socket path has at most 107 bytes
    tmp = tempfile.mkdtemp(prefix="snnconv-test-", dir="/tmp" if os.path.isdir("/tmp") else None)
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {**os.environ, "TMPDIR": tmp, "SNNCONV_LAVA_PYTHON": str(lava_python()),
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "backends")])}
    cli = subprocess.Popen([sys.executable, "-m", "snnconv.cli", "run", str(path), "--backend", "lava",
                            "--T", "2", "--limit", "8", "--quiet"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_keyboard_interrupt)
    shm: set[str] = set()
    worker = None
    try:
        deadline = time.monotonic() + HANG
        while cli.poll() is None and time.monotonic() < deadline:  # until Lava's runtime is up
            workers = [p for p in _children(cli.pid) if os.getpgid(p) == p] if worker is None else [worker]
            if workers:
                worker = workers[0]
                shm = _shared_memory(_group(worker))
                if len(shm) > 10:
                    break
            time.sleep(0.1)
        if cli.poll() is not None:
            pytest.fail(f"snnconv run ended before Lava started: {cli.communicate()[1]}")
        assert worker is not None and shm, "the Lava run never started"
        cli.send_signal(sig)
        _, err = cli.communicate()
    finally:
        if cli.poll() is None:
            cli.terminate()
            cli.communicate()
    assert cli.returncode == code and err.strip().splitlines()[-1] == f"snnconv run: {said}", err
    assert "Traceback" not in err
    assert _group(worker) == []                           # no Lava process left
    assert not [f for f in shm if os.path.exists(f)]      # its shared memory unlinked
    assert os.listdir(tmp) == []                          # the job and result files removed


@needs_lava
def test_the_lava_worker_ends_when_its_parent_dies(small_digits_snn, tmp_path):
    """The parent killed outright (no cleanup of its own runs): the worker sees its stdin end
    and stops its group."""
    import json

    import numpy as np
    import torch

    from snnconv.snn.nir_io import export_nir
    from snnconv_backends.lava import WORKER, LavaBackend

    program = LavaBackend().compile(export_nir(small_digits_snn))
    spec, arrays, _ = program.job(torch.rand(8, 1, 8, 8), 2)
    job = tmp_path / "job.npz"
    np.savez(job, spec=np.array(json.dumps(spec)), **arrays)
    worker = subprocess.Popen([str(lava_python()), str(WORKER), str(job), str(tmp_path / "out.npz"),
                               "--exit-with-parent"], stdin=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    shm: set[str] = set()
    try:
        deadline = time.monotonic() + HANG
        while worker.poll() is None and time.monotonic() < deadline:  # until Lava's runtime is up
            shm = _shared_memory(_group(worker.pid))
            if len(shm) > 10:
                break
            time.sleep(0.1)
        assert worker.poll() is None and shm, "the Lava run never started"
        worker.stdin.close()  # what the parent's death does to the pipe
        worker.wait()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    deadline = time.monotonic() + HANG
    while _group(worker.pid) and time.monotonic() < deadline:  # the last ones exit after the leader
        time.sleep(0.1)
    assert _group(worker.pid) == []
    assert not [f for f in shm if os.path.exists(f)]
