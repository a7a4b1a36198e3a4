"""``lava``: run a converted SNN in Intel's Lava (lava-nc 0.10.0, ``Loihi2SimCfg(select_tag="fixed_pt")``).

The graph is quantised exactly as for ``loihi2-sim`` (:func:`snnconv_backends.loihi2.quantize`)
and handed to Lava's bit-accurate process models in a subprocess of the Python 3.10 side
environment ``.venv-lava`` (built by ``make lava-env``; lava-nc 0.10.0 installs on Python 3.10
only), through npz files in a temporary folder. Lava runs the whole pipeline (``T + depth``
steps); the result keeps each population's own ``T`` steps, so it compares step for step with
``loihi2-sim``. Membrane voltages and spikes of every population are in ``extra["trace"]``.

Lava is the reference, not the workhorse: it runs one Python process per Lava process and
expands convolutions into (sparse) weight matrices, so keep networks and batches small. A run
that ends early (Ctrl-C, SIGTERM in snnconv's CLI, a timeout, the caller killed) stops every
process Lava started and leaves no shared memory or temporary file behind (:func:`run_worker`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from snnconv.errors import BackendError
from snnconv_backends import loihi2
from snnconv_backends._lava.procgroup import end_group
from snnconv_backends.loihi2.backend import attach_fidelity
from snnconv_backends.loihi2.simulate import connection_synops, static_eval, static_input
from snnconv_backends.registry import Backend, Program, Report, RunResult, parse_graph, readout_exit

__all__ = ["LavaBackend", "LavaProgram", "lava_python", "run_worker", "stop_group", "WORKER"]

#: The script run by the side environment's interpreter.
WORKER = Path(__file__).resolve().parent / "_lava" / "worker.py"
_OPTIONS: dict[str, Any] = {"python": None, "timeout": 1800.0, "step_seconds": loihi2.STEP_SECONDS,
            "dense_limit": 2**22, "max_memory_gb": None, "split_signs": True, "weight_groups": "auto",
            "dt": 1.0, "per_neuron_vth": True, "reference": True}


def lava_python() -> Path:
    """The side environment's interpreter: ``$SNNCONV_LAVA_PYTHON``, else ``<repo>/.venv-lava/bin/python``."""
    env = os.environ.get("SNNCONV_LAVA_PYTHON")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".venv-lava" / "bin" / "python"


_AVAILABLE: dict[str, tuple[bool, str]] = {}


def _check(python: Path) -> tuple[bool, str]:
    key = str(python)
    if key not in _AVAILABLE:
        if not python.exists():
            _AVAILABLE[key] = (False, f"no Lava side environment: {python} does not exist. Build it "
                                      "with `make lava-env` (needs a Python 3.10 interpreter; "
                                      "lava-nc 0.10.0 installs on Python 3.10 only), or point "
                                      "SNNCONV_LAVA_PYTHON at a Python with lava-nc 0.10.0")
        else:
            try:
                p = subprocess.run([str(python), "-c", "import lava.magma, lava.proc.lif.models; "
                                    "import importlib.metadata as m; print(m.version('lava-nc'))"],
                                   capture_output=True, text=True, timeout=120)
                ok = p.returncode == 0 and p.stdout.strip() == "0.10.0"
                _AVAILABLE[key] = (True, "") if ok else (
                    False, f"{python} cannot import lava-nc 0.10.0 (found {p.stdout.strip() or 'none'}; "
                           f"{p.stderr.strip()[-300:]}); rebuild it with `make lava-env`")
            except (OSError, subprocess.TimeoutExpired) as exc:
                _AVAILABLE[key] = (False, f"{python} does not run: {exc}")
    return _AVAILABLE[key]


def _address_space(gb: float):
    """A preexec function limiting each Lava process's address space to ``gb`` GiB (a failed
    allocation then ends the run with an error instead of waking the kernel's OOM killer)."""
    import resource

    def limit() -> None:
        n = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (n, n))

    return limit


def run_worker(cmd: list[str], workdir: str, *, timeout: float, grace: float = 10.0,
               preexec_fn: Any = None) -> tuple[int, str]:
    """Run the Lava worker ``cmd`` in a session of its own; return ``(exit code, its stderr)``.

    Lava forks one process per Lava process, and their shared memory lives in ``/dev/shm``.
    However the wait ends early (past ``timeout``: ``BackendError``; Ctrl-C, SIGTERM in
    snnconv's CLI, any exception: re-raised), the worker's whole process group is stopped
    first (:func:`stop_group`), so nothing of the run outlives the call. The worker's stdin is
    a pipe held open for the run: a worker started with ``--exit-with-parent`` ends its group
    when it closes, so the run also ends if this process is killed outright. Its stderr goes
    to ``workdir/worker.log``, and its temporary files (multiprocessing's ``pymp-*`` folders)
    into ``workdir`` (its ``TMPDIR``), which the caller removes.
    """
    log = os.path.join(workdir, "worker.log")
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True, preexec_fn=preexec_fn,
                                env={**os.environ, "TMPDIR": workdir})
    try:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            stop_group(proc, grace)
            raise BackendError(f"lava: the Lava run took more than {exc.timeout:.0f} s; use a "
                               "smaller batch or network, or a larger timeout= option") from None
        except BaseException:
            stop_group(proc, grace)
            raise
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
    with open(log) as f:
        return code, f.read()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member we cannot signal is still there
        return True
    return True


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop the worker ``proc`` and every process of its group (its session).

    :func:`~snnconv_backends._lava.procgroup.end_group` freezes the group, stops it (SIGTERM,
    SIGKILL after ``grace`` seconds) and unlinks the shared memory its processes had;
    multiprocessing's resource tracker (which ignores SIGTERM) then exits by itself. At a second
    Ctrl-C whatever still runs gets SIGKILL. Returns once the worker is reaped.
    """
    pgid = proc.pid
    try:
        end_group(pgid, grace)
        deadline = time.monotonic() + grace
        while (proc.poll() is None or _group_alive(pgid)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:  # past the grace period, or interrupted again
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


class LavaProgram(Program):
    """A quantised graph that runs in Lava; ``run`` starts one Lava run per call."""

    def __init__(self, q: loihi2.QuantizedNetwork, options: Mapping[str, Any]):
        self.q = q
        self.options = dict(options)

    def job(self, x: torch.Tensor, T: int) -> tuple[dict[str, Any], dict[str, Any], int]:
        """The worker's job for a static batch ``x``: (spec, arrays, first-layer bias clips)."""
        q = self.q
        B = x.shape[0]
        vals = static_eval(q, x.float())
        shapes = {p.name: p.shape for p in q.populations}
        shapes[loihi2.CLOCK] = (1,)
        arrays: dict[str, Any] = {}  # name -> ndarray (np.savez)
        pops = []
        k = 0
        clipped = 0
        for j, p in enumerate(q.populations):
            if p.has_bias:
                mant, exp, n_clipped = loihi2.bias_current(static_input(q, p, vals, B), p)
                clipped += n_clipped
                arrays[f"p{j}_bias_mant"] = mant.cpu().numpy().astype(np.int32)
                arrays[f"p{j}_bias_exp"] = exp.cpu().numpy().astype(np.int32)
            conns = []
            for c in p.conns:
                rows, cols, v = c.coo(shapes[c.source], p.shape)
                v = np.asarray(v, np.int32)
                # a split connection is two single-sign synapse groups (two processes)
                parts = ([(c.name + "+", v > 0), (c.name + "-", v < 0)]
                         if c.report.get("sign_mode") == "split" else [(c.name, slice(None))])
                for name, sel in parts:
                    arrays[f"c{k}_rows"] = np.asarray(rows, np.int64)[sel]
                    arrays[f"c{k}_cols"] = np.asarray(cols, np.int64)[sel]
                    arrays[f"c{k}_vals"] = v[sel]
                    conns.append({"index": k, "name": name, "source": c.source, "exp": int(c.exp),
                                  "delay": int(c.delay)})
                    k += 1
            per_neuron = isinstance(p.v_init, np.ndarray)
            if per_neuron:  # a calibrated initial membrane: one value per neuron
                arrays[f"p{j}_v_init"] = np.asarray(p.v_init, np.int32)
            per_vth = bool(np.ndim(p.vth))
            if per_vth:  # one threshold per channel: one value per neuron
                arrays[f"p{j}_vth"] = p.neuron_vth().astype(np.int32)
            pops.append({"name": p.name, "role": p.role, "size": p.size, "reset": p.reset,
                         "vth": None if per_vth else int(p.vth),
                         "v_init": None if per_neuron else int(p.v_init),
                         "static": bool(p.static), "bias_from": 0 if p.static or not p.has_bias else int(p.depth),
                         "conns": conns, "du": int(p.du), "dv": int(p.dv), "burst": int(p.burst)})
        spec = {"steps": T + q.depth, "batch": B, "populations": pops,
                "dense_limit": int(self.options["dense_limit"])}
        return spec, arrays, clipped

    default_batch = 16  # each call starts a Lava process: few images per call bound its memory

    def report(self, runs: list[RunResult], *, analog_macs_per_image: float = 0.0) -> Report:
        """As loihi2-sim's (:func:`snnconv_backends.loihi2.report.chip_report`)."""
        from snnconv_backends.loihi2.report import chip_report

        return chip_report(self.q, runs, "lava", analog_macs_per_image)

    def run(self, x: torch.Tensor, T: int, *, exit_rule: Any = None) -> RunResult:
        """``exit_rule``: Lava runs all T steps; the rule is applied to the readout (:func:`readout_exit`)."""
        if exit_rule is not None:
            return readout_exit(self.run(x, T), exit_rule, "lava")
        x, T = loihi2.check_input(self.q, x, T, "lava")
        x = x.detach().cpu()
        t0 = time.perf_counter()
        spec, arrays, clipped = self.job(x, T)
        python = Path(self.options["python"]) if self.options["python"] else lava_python()
        ok, reason = _check(python)
        if not ok:
            raise BackendError(f"lava: {reason}")
        with tempfile.TemporaryDirectory(prefix="snnconv-lava-") as tmp:
            job, out = os.path.join(tmp, "job.npz"), os.path.join(tmp, "result.npz")
            np.savez(job, spec=np.array(json.dumps(spec)), **arrays)
            limit = self.options["max_memory_gb"]
            code, stderr = run_worker([str(python), str(WORKER), job, out, "--exit-with-parent"], tmp,
                                      timeout=float(self.options["timeout"]),
                                      preexec_fn=None if limit is None else _address_space(float(limit)))
            if code != 0 or not os.path.exists(out):
                raise BackendError(f"lava: the Lava worker failed (exit {code}): {stderr.strip()[-2000:]}")
            with np.load(out, allow_pickle=False) as res:
                data = {k: res[k] for k in res.files}
        res = self._result(data, spec, T, x.shape[0], clipped)
        res.extra["seconds"] = time.perf_counter() - t0
        return attach_fidelity(self.q, res, x, T, "lava", bool(self.options["reference"]))

    def _result(self, data: Mapping[str, np.ndarray], spec: Mapping[str, Any], T: int, B: int,
                clipped: int) -> RunResult:
        q = self.q
        v_win: dict[str, Any] = {}
        s_win: dict[str, Any] = {}
        counts: dict[str, Any] = {}
        synops: dict[str, Any] = {}
        before_ok = True
        for j, p in enumerate(q.populations):
            d = p.depth
            v = torch.from_numpy(data[f"v{j}"])
            v_win[p.name] = v[d:d + T].clone()
            if p.role != "readout":
                s = torch.from_numpy(data[f"s{j}"])
                s_win[p.name] = s[d:d + T].clone()
                counts[p.name] = s_win[p.name].reshape(T, -1).sum(1).float()
                v0 = torch.as_tensor(np.asarray(p.v_init, np.int64))
                if d:
                    before_ok &= bool((v[:d].reshape(d, -1, p.size) == v0).all()) and not bool(s[:d].any())
        for p in q.populations:
            for c in p.conns:
                if c.kind == "bias":
                    synops[c.name] = synops.get(c.name, 0.0) + float(T * B) * float(c.fanout.sum())
                else:
                    per_neuron = s_win[c.source].reshape(T * B, -1).float().sum(0)
                    synops[c.name] = synops.get(c.name, 0.0) + connection_synops(c, per_neuron)
        r = q.readout
        out = v_win[r.name].double() / torch.as_tensor(r.membrane_scale(), dtype=torch.float64)
        out = out.float().reshape(T, B, *q.graph.output_shape)

        class _NotObserved:
            saturated = wrapped = -1
            bias_clipped = clipped

        extra = {"trace": {"v": v_win, "s": s_win},
                 "lava": {"steps": int(spec["steps"]), "build_seconds": float(data["seconds"][0]),
                          "run_seconds": float(data["seconds"][1]),
                          "idle_before_window": before_ok,
                          "note": "Lava clips and wraps without counting (-1 = not observed); "
                                  "loihi2-sim counts them"}}
        return loihi2.build_result(q, out, counts, _NotObserved, synops, T, B,
                                   float(self.options["step_seconds"]), extra)


class LavaBackend(Backend):
    """Runs the graph in Intel's Lava (fixed_pt models) in the ``.venv-lava`` side environment.

    Options: ``python`` (the interpreter with lava-nc 0.10.0), ``timeout`` (seconds per run),
    ``step_seconds`` (latency estimate), ``dense_limit`` (connections with more matrix entries
    than this, batch included, run as Lava ``Sparse`` instead of ``Dense``), ``max_memory_gb``
    (address-space limit per Lava process), ``split_signs`` and ``weight_groups`` (as
    loihi2-sim's).
    """

    name = "lava"

    def availability(self) -> tuple[bool, str]:
        return _check(lava_python())

    def compile(self, graph: Any, **options: Any) -> LavaProgram:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise BackendError(f"lava: unknown option(s) {unknown}; known: {sorted(_OPTIONS)}")
        opts = dict(_OPTIONS)
        opts.update(options)
        return LavaProgram(loihi2.quantize(parse_graph(graph, self.name, opts["dt"]),
                                           split_signs=bool(opts["split_signs"]),
                                           weight_groups=opts["weight_groups"],
                                           per_neuron_vth=bool(opts["per_neuron_vth"]), backend=self.name), opts)
