"""Run a quantised snnconv network in Intel's Lava (lava-nc 0.10.0, ``fixed_pt`` models).

Run by the ``lava`` backend as ``.venv-lava/bin/python worker.py JOB.npz RESULT.npz
--exit-with-parent`` in a session of its own. Imports numpy, scipy (a Lava dependency), lava and
the standard library only. With ``--exit-with-parent``, the end of stdin (the backend's process
closed the pipe, or died) ends the run: Lava's processes are stopped and their shared memory
unlinked (``procgroup.end_group``), then this process group gets SIGTERM.

The job (npz): ``spec`` (JSON: steps, batch, populations with their connections) and integer
arrays: per connection ``c<i>_rows`` / ``c<i>_cols`` / ``c<i>_vals`` (one image's weight
mantissas, COO), per first-layer population ``p<j>_bias_mant`` / ``p<j>_bias_exp`` ``[B, N]``.
The batch runs as B copies of the network side by side (block-diagonal connections).

Processes: hard reset -> Lava's ``LIF`` (``PyLifModelBitAcc``: du=4095, dv=0); NIR's LIF and
CubaLIF -> Lava's ``LIF`` with the population's du, dv; an LI readout -> Lava's ``LIF`` with
its dv and the largest threshold (its membrane is bounded below it at compile time); subtractive
reset -> :class:`SubtractiveIF`, whose model reuses Lava's fixed-point LIF dynamics
(``AbstractPyLifModelFixed``) and only replaces the reset (v -= vth << 6) - on Loihi 2 a
custom neuron program; the readout -> :class:`Readout` (v = clip24(a_in << 6), no spikes);
connections -> ``Dense`` / ``Sparse`` (``DelayDense`` / ``DelaySparse`` with extra delays);
biases of later layers -> one always-on ``LIF`` ("clock") and a connection per layer; one
threshold per neuron -> :class:`ChannelIF` (a custom neuron program, either reset); a burst
neuron -> :class:`BurstIF` (graded spikes: the count, read by its connections with
``num_message_bits``); a static
input that reaches a population at depth d beside spikes -> its bias current, written after the
first d steps (the run pauses there: its input arrives at step d + 1).

The result (npz): ``v<j>`` ``[steps, B, N]`` int32 (membrane after reset) and ``s<j>``
``[steps, B, N]`` bool per population (uint8 counts for a burst population), ``seconds``
(build + run wall time).
"""

import json
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np
import scipy.sparse as sp
from lava.magma.core.decorator import implements, requires, tag
from lava.magma.core.model.py.ports import PyOutPort
from lava.magma.core.model.py.type import LavaPyType
from lava.magma.core.process.ports.ports import InPort, OutPort
from lava.magma.core.process.process import AbstractProcess
from lava.magma.core.process.variable import Var
from lava.magma.core.resources import CPU
from lava.magma.core.run_conditions import RunSteps
from lava.magma.core.run_configs import Loihi2SimCfg
from lava.magma.core.sync.protocols.loihi_protocol import LoihiProtocol
from lava.proc.dense.process import DelayDense, Dense
from lava.proc.lif.models import AbstractPyLifModelFixed
from lava.proc.lif.process import LIF
from lava.proc.monitor.process import Monitor
from lava.proc.sparse.process import DelaySparse, Sparse
from procgroup import end_group  # type: ignore[import-not-found]  # this script's folder is first on sys.path

DENSE_LIMIT = 2**22  # entries; larger connections use Sparse
LI_VTH = 2**17 - 1  # the largest threshold: an LI readout's membrane is bounded below it


def _if_vars(proc, shape, v, bias_mant, bias_exp) -> None:
    """The ports and variables Lava's fixed-point LIF model reads (du = 4095, dv = 0: IF)."""
    proc.a_in = InPort(shape=shape)
    proc.s_out = OutPort(shape=shape)
    proc.u = Var(shape=shape, init=0)
    proc.v = Var(shape=shape, init=v)
    proc.du = Var(shape=(1,), init=4095)
    proc.dv = Var(shape=(1,), init=0)
    proc.bias_mant = Var(shape=shape, init=bias_mant)
    proc.bias_exp = Var(shape=shape, init=bias_exp)


class SubtractiveIF(AbstractProcess):
    """Integrate-and-fire neuron with reset by subtraction (Loihi 2 custom neuron program).

    u[t] = a_in << 6 (du = 4095); v[t] = clip24(v[t-1] + u[t] + bias);
    s = v > vth << 6; v -= vth << 6 where s.
    """

    def __init__(self, *, shape, vth, v=0, bias_mant=0, bias_exp=0, name=None):
        super().__init__(shape=shape, name=name)
        _if_vars(self, shape, v, bias_mant, bias_exp)
        self.vth = Var(shape=(1,), init=vth)


@implements(proc=SubtractiveIF, protocol=LoihiProtocol)
@requires(CPU)
@tag("fixed_pt")
class PySubtractiveIFModelFixed(AbstractPyLifModelFixed):
    """Lava's fixed-point LIF dynamics with a subtractive reset."""

    s_out: PyOutPort = LavaPyType(PyOutPort.VEC_DENSE, np.int32, precision=24)
    vth: int = LavaPyType(int, np.int32, precision=17)

    def scale_threshold(self):
        self.effective_vth = np.left_shift(self.vth, self.vth_shift)
        self.isthrscaled = True

    def spiking_activation(self):
        return self.v > self.effective_vth

    def reset_voltage(self, spike_vector):
        self.v[spike_vector] -= self.effective_vth


class ChannelIF(AbstractProcess):
    """Integrate-and-fire neuron with one threshold per neuron (Loihi 2 custom neuron program),
    reset to 0 (``hard``) or by subtraction; otherwise as :class:`SubtractiveIF`."""

    def __init__(self, *, shape, vth, hard, v=0, bias_mant=0, bias_exp=0, name=None):
        super().__init__(shape=shape, name=name)
        _if_vars(self, shape, v, bias_mant, bias_exp)
        self.vth = Var(shape=shape, init=vth)
        self.hard = Var(shape=(1,), init=int(bool(hard)))


@implements(proc=ChannelIF, protocol=LoihiProtocol)
@requires(CPU)
@tag("fixed_pt")
class PyChannelIFModelFixed(AbstractPyLifModelFixed):
    """Lava's fixed-point LIF dynamics with a threshold per neuron and either reset."""

    s_out: PyOutPort = LavaPyType(PyOutPort.VEC_DENSE, np.int32, precision=24)
    vth: np.ndarray = LavaPyType(np.ndarray, np.int32, precision=17)
    hard: np.ndarray = LavaPyType(np.ndarray, np.int32, precision=1)

    def scale_threshold(self):
        self.effective_vth = np.left_shift(self.vth.astype(np.int64), self.vth_shift)
        self.isthrscaled = True

    def spiking_activation(self):
        return self.v > self.effective_vth

    def reset_voltage(self, spike_vector):
        if int(self.hard[0]):
            self.v[spike_vector] = 0
        else:
            self.v[spike_vector] -= self.effective_vth[spike_vector]


class BurstIF(AbstractProcess):
    """Integrate-and-fire neuron with reset by subtraction that emits up to ``burst`` spikes a
    step as one graded spike (Loihi 2 custom neuron program; one threshold per neuron):
    s = clip((v - 1) // (vth << 6), 0, burst), i.e. the k with v > k * (vth << 6); v -= s * (vth << 6).
    """

    def __init__(self, *, shape, vth, burst, v=0, bias_mant=0, bias_exp=0, name=None):
        super().__init__(shape=shape, name=name)
        _if_vars(self, shape, v, bias_mant, bias_exp)
        self.vth = Var(shape=shape, init=vth)
        self.burst = Var(shape=(1,), init=int(burst))


@implements(proc=BurstIF, protocol=LoihiProtocol)
@requires(CPU)
@tag("fixed_pt")
class PyBurstIFModelFixed(AbstractPyLifModelFixed):
    """Lava's fixed-point LIF dynamics with graded spikes (the count) and a subtractive reset."""

    s_out: PyOutPort = LavaPyType(PyOutPort.VEC_DENSE, np.int32, precision=24)
    vth: np.ndarray = LavaPyType(np.ndarray, np.int32, precision=17)
    burst: np.ndarray = LavaPyType(np.ndarray, np.int32, precision=8)

    def scale_threshold(self):
        self.effective_vth = np.left_shift(self.vth.astype(np.int64), self.vth_shift)
        self.isthrscaled = True

    def spiking_activation(self):
        count = np.floor_divide(self.v.astype(np.int64) - 1, self.effective_vth)
        return np.clip(count, 0, int(self.burst[0])).astype(np.int32)

    def reset_voltage(self, spike_vector):
        self.v[:] = (self.v.astype(np.int64) - spike_vector.astype(np.int64) * self.effective_vth).astype(np.int32)


class Readout(AbstractProcess):
    """Non-spiking readout: v[t] = clip24(u[t]) with u[t] = a_in << 6 (read every step)."""

    def __init__(self, *, shape, name=None):
        super().__init__(shape=shape, name=name)
        self.a_in = InPort(shape=shape)
        self.u = Var(shape=shape, init=0)
        self.v = Var(shape=shape, init=0)
        self.du = Var(shape=(1,), init=4095)
        self.dv = Var(shape=(1,), init=0)
        self.bias_mant = Var(shape=shape, init=0)
        self.bias_exp = Var(shape=shape, init=0)


@implements(proc=Readout, protocol=LoihiProtocol)
@requires(CPU)
@tag("fixed_pt")
class PyReadoutModelFixed(AbstractPyLifModelFixed):
    """Lava's fixed-point current/voltage update with the voltage cleared before each step."""

    def run_spk(self):
        a_in_data = self.a_in.recv()
        self.scale_bias()
        self.v[:] = 0
        self.subthr_dynamics(activation_in=a_in_data)


def _block(rows, cols, vals, n_tgt, n_src, B):
    """One image's COO matrix, repeated for B images along the diagonal (CSR)."""
    one = sp.coo_matrix((vals.astype(np.int32), (rows, cols)), shape=(n_tgt, n_src)).tocsr()
    return sp.block_diag([one] * B, format="csr") if B > 1 else one


def exit_with_parent():
    """End this process group when stdin ends (a thread reads it to its end).

    The thread reads file descriptor 0 itself, never ``sys.stdin``: a forked Lava process
    closes ``sys.stdin``, which would wait forever for the lock a reading thread holds.
    """
    def watch():
        while os.read(0, 4096):
            pass
        end_group(os.getpgid(0), spare=os.getpid())
        os.killpg(os.getpgid(0), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(job_path, out_path):
    warnings.filterwarnings("ignore", message="Cannot import module")
    t0 = time.time()
    job = np.load(job_path, allow_pickle=False)
    spec = json.loads(str(job["spec"]))
    steps, B = int(spec["steps"]), int(spec["batch"])
    procs, sizes = {}, {}
    late = {}  # step -> [(population, bias mantissas, exponents)]
    clock = None
    for j, p in enumerate(spec["populations"]):
        n = int(p["size"]) * B
        sizes[p["name"]] = int(p["size"])
        if p["static"]:
            mant = job[f"p{j}_bias_mant"].reshape(n).astype(np.int32)
            exp = job[f"p{j}_bias_exp"].reshape(n).astype(np.int32)
        elif p.get("bias_from"):  # a late static input: its bias is written at step bias_from
            mant = np.zeros(n, np.int32)
            exp = np.zeros(n, np.int32)
            late.setdefault(int(p["bias_from"]), []).append(
                (p["name"], job[f"p{j}_bias_mant"].reshape(n).astype(np.int32),
                 job[f"p{j}_bias_exp"].reshape(n).astype(np.int32)))
        else:
            mant = np.zeros(n, np.int32)
            exp = np.zeros(n, np.int32)
        du, dv = int(p.get("du", 4095)), int(p.get("dv", 0))
        if p["role"] == "readout" and dv:  # a leaky (LI) readout: Lava's LIF below any threshold
            procs[p["name"]] = LIF(shape=(n,), du=du, dv=dv, vth=LI_VTH, v=0, name=p["name"])
        elif p["role"] == "readout":
            procs[p["name"]] = Readout(shape=(n,), name=p["name"])
        elif int(p.get("burst", 1)) > 1:  # graded spikes: a threshold per neuron
            v0 = (int(p["v_init"]) if p["v_init"] is not None
                  else np.tile(job[f"p{j}_v_init"].astype(np.int32), B))
            vth = (np.full(n, int(p["vth"]), np.int32) if p["vth"] is not None
                   else np.tile(job[f"p{j}_vth"].astype(np.int32), B))
            procs[p["name"]] = BurstIF(shape=(n,), vth=vth, burst=int(p["burst"]), v=v0,
                                       bias_mant=mant, bias_exp=exp, name=p["name"])
        elif p["vth"] is None:  # one threshold per neuron
            v0 = (int(p["v_init"]) if p["v_init"] is not None
                  else np.tile(job[f"p{j}_v_init"].astype(np.int32), B))
            procs[p["name"]] = ChannelIF(shape=(n,), vth=np.tile(job[f"p{j}_vth"].astype(np.int32), B),
                                         hard=p["reset"] == "zero", v=v0, bias_mant=mant,
                                         bias_exp=exp, name=p["name"])
        elif p["reset"] == "zero":  # hard-reset IF (du=4095, dv=0), LIF and CubaLIF
            procs[p["name"]] = LIF(shape=(n,), du=du, dv=dv, vth=int(p["vth"]), v=0,
                                   bias_mant=mant, bias_exp=exp, name=p["name"])
        else:
            v0 = (int(p["v_init"]) if p["v_init"] is not None
                  else np.tile(job[f"p{j}_v_init"].astype(np.int32), B))  # batch-major, as the biases
            procs[p["name"]] = SubtractiveIF(shape=(n,), vth=int(p["vth"]), v=v0,
                                             bias_mant=mant, bias_exp=exp, name=p["name"])
    conns = []
    bursts = {p["name"]: int(p.get("burst", 1)) for p in spec["populations"]}
    for p in spec["populations"]:
        for c in p["conns"]:
            i = int(c["index"])
            rows, cols, vals = job[f"c{i}_rows"], job[f"c{i}_cols"], job[f"c{i}_vals"]
            n_tgt = sizes[p["name"]]
            if c["source"] == "__clock__":
                if clock is None:  # always on: bias 1 > vth 0 at every step
                    clock = LIF(shape=(1,), du=4095, dv=0, vth=0, bias_mant=1, bias_exp=0,
                                name="__snnconv_clock__")
                src, n_src = clock, 1
                w = sp.vstack([sp.coo_matrix((vals.astype(np.int32), (rows, cols)), shape=(n_tgt, 1))] * B).tocsr()
            else:
                src, n_src = procs[c["source"]], sizes[c["source"]]
                w = _block(rows, cols, vals, n_tgt, n_src, B)
            delay, exp = int(c["delay"]), int(c["exp"])
            dense = w.shape[0] * w.shape[1] <= int(spec.get("dense_limit", DENSE_LIMIT))
            # a burst source's graded spikes: the weight times the count
            bits = {"num_message_bits": 8} if int(bursts.get(c["source"], 1)) > 1 else {}
            if delay == 0:
                conn = (Dense(weights=w.toarray(), weight_exp=exp, **bits) if dense
                        else Sparse(weights=w, weight_exp=exp, **bits))
            elif dense:
                conn = DelayDense(weights=w.toarray(), delays=np.full(w.shape, delay, dtype=int),
                                  weight_exp=exp, **bits)
            else:
                # delays with the weights' sparsity (an int would be expanded to a dense matrix)
                delays = w.copy()
                delays.data = np.full(delays.data.shape, delay, dtype=int)
                conn = DelaySparse(weights=w, delays=delays, weight_exp=exp, **bits)
            src.s_out.connect(conn.s_in)
            conn.a_out.connect(procs[p["name"]].a_in)
            conns.append(conn)
    mons = {}  # one Monitor per probe (a Monitor with several probes fails to compile in 0.10.0)
    for p in spec["populations"]:
        mons[p["name"], "v"] = Monitor()
        mons[p["name"], "v"].probe(procs[p["name"]].v, steps)
        if p["role"] != "readout":
            mons[p["name"], "s_out"] = Monitor()
            mons[p["name"], "s_out"].probe(procs[p["name"]].s_out, steps)
    first = next(iter(procs.values()))
    t1 = time.time()
    cfg = Loihi2SimCfg(select_tag="fixed_pt")
    done = 0
    for at in sorted(late):  # run to each step where a late bias starts, write it, go on
        first.run(condition=RunSteps(num_steps=at - done), run_cfg=cfg)
        for name, mant, exp in late[at]:
            procs[name].bias_mant.set(mant)
            procs[name].bias_exp.set(exp)
        done = at
    first.run(condition=RunSteps(num_steps=steps - done), run_cfg=cfg)
    t2 = time.time()
    out = {"seconds": np.array([t1 - t0, t2 - t1])}
    for j, p in enumerate(spec["populations"]):
        n = sizes[p["name"]]
        for var, key in (("v", f"v{j}"), ("s_out", f"s{j}")):
            if (p["name"], var) not in mons:
                continue
            rec = np.asarray(mons[p["name"], var].get_data()[p["name"]][var]).reshape(steps, B, n)
            out[key] = (rec.astype(np.int32) if var == "v" else
                        rec.astype(np.uint8) if int(p.get("burst", 1)) > 1 else rec != 0)
    first.stop()
    np.savez(out_path, **out)


if __name__ == "__main__":
    if "--exit-with-parent" in sys.argv[3:]:
        exit_with_parent()
    main(sys.argv[1], sys.argv[2])
