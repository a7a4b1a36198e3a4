"""``snnconv report RUN_DIR``: one self-contained HTML page (plots embedded) from a run folder.

A run folder is what the CLI commands and the tutorial notebooks write (every file optional):

======================  ==============================================================
``meta.json``           ``snnconv convert``: accuracies (ANN, folded, QCFS-ANN, SNN by T),
                        per-stage records (thresholds), settings, environment
``finetune.json``       ``snnconv finetune``: ``history`` (one record per epoch) and
                        ``accuracy`` (``{"snn": {T: acc}}`` after fine-tuning)
``evaluation.json``     ``snnconv evaluate``: ``accuracy`` by T and ``analysis`` (a
                        :class:`snnconv.analysis.activity.SpikeAnalysis` as data);
                        with a rule, ``early_exit`` (accuracy, mean steps, exit histogram,
                        the curve of the rule's kind and the fixed-T run cut at each step)
``backends/*.json``     ``snnconv run``: one file per backend, T, data, image count and
                        settings: accuracy, agreement with the torch SNN, synaptic
                        operations, MACs, energy and wall time
======================  ==============================================================

The page opens with a headline (the network, its T, ANN -> SNN accuracy with the number of
test images, and what the conversion cost; the mean steps where early exit was evaluated);
every accuracy is given with its image count, and
every section states the T it shows. Fine-tuning is shown from wherever the run recorded it
(convert's BPTT stage in ``meta.json``, ``finetune.json``). A measured point that rests on few
images (:func:`few_images`) is kept out of the accuracy plot, whose axis it would stretch, and
named under it. Sections whose data is absent are replaced by a one-line note saying which
command writes it.
The page is written atomically; images are PNGs embedded as base64 (no file references), so
the page can be mailed or attached to a CI run as it is.
"""

from __future__ import annotations

import base64
import datetime as _dt
import glob
import html
import io
import json
import math
import os
from typing import Any, Callable, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from snnconv.analysis.energy import ARITHMETIC, ARITHMETIC_NOTE, CHIP_NOTE  # noqa: E402
from snnconv.analysis.plots import (  # noqa: E402
    curve_points,
    draw_accuracy,
    draw_energy,
    draw_exit,
    draw_firing,
    draw_history,
    draw_ops,
    draw_raster,
    draw_thresholds,
)
from snnconv.analysis.summary import beyond_ann  # noqa: E402
from snnconv.errors import DataError  # noqa: E402
from snnconv.exit_rule import ExitRule  # noqa: E402
from snnconv.io.atomic import atomic_write_text  # noqa: E402
from snnconv.progress import duration  # noqa: E402

__all__ = ["write_report", "load_run", "energy_comparisons", "headline", "few_images", "REPORT_NAME",
           "FEW_IMAGES"]

REPORT_NAME = "report.html"

#: A measured accuracy on fewer images than this (and than a tenth of the largest count shown)
#: stays out of the accuracy plot: on 4 images one image moves it by 25 points.
FEW_IMAGES = 100


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); re-run the command that wrote it") from exc


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read the JSON files of a run folder into ``{"meta", "finetune", "evaluation", "diagnosis",
    "backends"}``.

    Missing files give ``None`` (``{}`` for backends).

    Raises:
        DataError: ``run_dir`` is not a folder, holds none of the files, or a file is not JSON.
    """
    run_dir = os.fspath(run_dir)
    if os.path.isfile(run_dir):
        raise DataError(f"{run_dir} is a file, not a run folder; give the folder holding it "
                        f"({os.path.dirname(run_dir) or '.'})")
    if not os.path.isdir(run_dir):
        raise DataError(f"run folder {run_dir} does not exist; give the --out folder of "
                        "'snnconv convert' (or of a tutorial notebook)")
    run: dict[str, Any] = {}
    for key in ("meta", "finetune", "evaluation", "diagnosis"):
        path = os.path.join(run_dir, f"{key}.json")
        run[key] = _read_json(path) if os.path.exists(path) else None
    # every file of a run records its run id: one left by an earlier run in the folder is left out
    run_id = ((run["meta"] or {}).get("settings") or {}).get("run_id")
    run["left_out"] = []
    for key in ("finetune", "evaluation", "diagnosis"):
        found = (run[key] or {}).get("run_id") if isinstance(run[key], dict) else None
        if run_id and found and found != run_id:
            run["left_out"].append(f"{key}.json (run {found[:8]}, not the run of meta.json: {run_id[:8]})")
            run[key] = None
    run["backends"] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "backends", "*.json"))):
        run["backends"][os.path.splitext(os.path.basename(path))[0]] = _read_json(path)
    if not any(run[k] for k in ("meta", "finetune", "evaluation", "backends")):
        raise DataError(f"{run_dir} holds none of meta.json, finetune.json, evaluation.json, "
                        "backends/*.json; run 'snnconv convert --out DIR' first")
    return run


# --- plots ----------------------------------------------------------------------------------

def _png(draw: Callable[[Any], None], size=(6.4, 3.8), ncols: int = 1) -> str:
    """``draw(ax)`` (``ncols`` > 1: ``draw(axes)``) as a base64 PNG."""
    fig, ax = plt.subplots(1, ncols, figsize=size)
    try:
        draw(ax)
        buf = io.BytesIO()
        fig.savefig(buf, dpi=100, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def energy_comparisons(analysis: Mapping[str, Any] | None, backends: Mapping[str, Any]) -> list[dict]:
    """One SNN-against-ANN row per target and energy model: evaluate's (the torch SNN), each
    backend's arithmetic one and a chip backend's own (nJ per image), each with its model named."""
    rows = []
    e = (analysis or {}).get("energy") or {}
    if e.get("ann_pj"):
        rows.append({"target": "evaluate (torch SNN)", "images": (analysis or {}).get("batch", ""),
                     "T": (analysis or {}).get("T", ""),
                     "model": ARITHMETIC, "short": "45 nm", "snn_nj": e["snn_pj"] / 1e3,
                     "ann_nj": e["ann_pj"] / 1e3, "ratio": e["ratio"]})
    for name, res in backends.items():
        name = res.get("backend", name)
        exit_ = res.get("early_exit") or {}
        if exit_ and exit_.get("counted", "dropped" if exit_.get("dropped") else "all T") != "all T":
            name += f" (early exit: a mean of {exit_['mean_steps']:.2f} steps)"
        a = res.get("energy") or {}
        T = res.get("T", "")
        if a.get("ann_pj"):
            rows.append({"target": f"run --backend {name}", "images": res.get("images", ""), "T": T,
                         "model": ARITHMETIC, "short": "45 nm", "snn_nj": a["snn_pj"] / 1e3,
                         "ann_nj": a["ann_pj"] / 1e3, "ratio": a["ratio"]})
        chip = (res.get("extra") or {}).get("energy") or {}
        if chip.get("ann_per_image_J"):
            rows.append({"target": f"run --backend {name}", "images": res.get("images", ""), "T": T,
                         "model": chip.get("model", CHIP_NOTE), "short": "chip figures",
                         "snn_nj": chip["per_image_J"] * 1e9, "ann_nj": chip["ann_per_image_J"] * 1e9,
                         "ratio": chip["snn_over_ann"]})
    return rows


# --- page -----------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:980px;margin:2em auto;
     padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right} th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.note{color:#777;font-style:italic} .meta{color:#555;font-size:.9em}
.headline{font-size:1.08em;border-left:4px solid #4a7;padding:.1em .8em;margin:.8em 0;background:#f6faf7}
.headline p{margin:.35em 0} h3{font-size:1.05em;margin-top:1.4em}
"""


# Marks <body data-plots="loaded/total"> once the page has loaded: a browser check (and a
# reader's devtools) can see that every embedded plot decoded.
_LOADED_SCRIPT = """<script>window.addEventListener('load',function(){var i=document.images,n=0;
for(var k=0;k<i.length;k++){if(i[k].complete&&i[k].naturalWidth>0)n++;}
document.body.setAttribute('data-plots',n+'/'+i.length);});</script>"""


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) >= 1e4 or (v and abs(v) < 1e-2) else f"{v:.2f}"
        return html.escape(str(v))
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(b64: str, alt: str) -> str:
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _thresholds(meta: Mapping[str, Any] | None) -> dict[str, list[float]]:
    if not meta:
        return {}
    for stage in meta.get("stages", []):
        if stage.get("name") == "spiking":
            out = {}
            for name, rec in (stage.get("changes", {}).get("neurons") or {}).items():
                theta = rec.get("theta")
                if theta is not None:
                    out[name] = [float(v) for v in (theta if isinstance(theta, list) else [theta])]
            return out
    return {}


def _energy_section(analysis: Mapping[str, Any] | None, backends: Mapping[str, Any], parts: list[str]) -> None:
    comparisons = energy_comparisons(analysis, backends)
    if comparisons:
        parts.append("<h2>Energy: the SNN against the ANN, per target</h2>")
        parts.append(_table(["target", "images", "T", "energy model", "SNN (nJ / image)", "ANN (nJ / image)",
                             "SNN/ANN"], [[c["target"], c["images"], c["T"], c["model"], f"{c['snn_nj']:.1f}",
                                           f"{c['ann_nj']:.1f}", f"{c['ratio']:.3f}"] for c in comparisons]))
        parts.append(f"<p>Why two targets differ. Rows of the energy model <i>{html.escape(ARITHMETIC)}"
                     f"</i> share one definition ({html.escape(ARITHMETIC_NOTE)}), counted on the spiking "
                     "graph as the backends run it: for the same images and spikes they give the same "
                     "figure, so a difference between them comes from the images (evaluate analyses the "
                     "first images of the test set, <code>snnconv run</code> its <code>--limit</code>), "
                     "from the spikes (a fixed-point backend's differ from the float network's) or from "
                     "the synapses (<code>loihi2-sim</code> gives a connection a second synapse group, "
                     "listed as <code>.lo</code>, where 8-bit weights round it too coarsely: each spike "
                     "then reaches two synapses). "
                     "A chip row uses "
                     f"{html.escape(CHIP_NOTE)}. The two models answer different questions; compare a "
                     "ratio only with rows of the same model.</p>")
        energy_rows = [(f"{c['target']}, T={c['T']}: SNN ({c['short']})", c["snn_nj"]) for c in comparisons]
        energy_rows += [(f"ANN ({c['short']})", c["ann_nj"]) for c in comparisons[:1]]
        parts.append(_img(_png(lambda ax: draw_energy(ax, energy_rows),
                               size=(6.4, 0.5 * len(energy_rows) + 1.4)), "energy"))


def few_images(n: Any, largest: int) -> bool:
    """Whether an accuracy measured on ``n`` images rests on too few to be plotted beside results
    on ``largest`` images: fewer than :data:`FEW_IMAGES` and than a tenth of ``largest``."""
    return isinstance(n, int) and n < FEW_IMAGES and 10 * n < largest


def _images(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "not recorded"


def _subset(n: Any, largest: int) -> str:
    """``" (a subset: 128 of 1,000)"`` where ``n`` images are fewer than the run's ``largest``."""
    return f" (a subset: {n:,} of {largest:,})" if isinstance(n, int) and 0 < n < largest else ""


def _model_name(meta: Mapping[str, Any]) -> str:
    settings = meta.get("settings") or {}
    prepared = next((s.get("changes") or {} for s in meta.get("stages", []) if s.get("name") == "prepare"), {})
    return str(settings.get("model") or prepared.get("model") or "A network")


def _horizons(cfg: Mapping[str, Any], default: Any = None) -> str:
    """The horizons fine-tuning unrolled over: ``"2, 4, 8"``, or its one ``T``."""
    return ", ".join(str(t) for t in cfg.get("horizons") or [cfg.get("T", default)] if t)


def _cost(meta: Mapping[str, Any]) -> str:
    """``"3 min 05 s on cpu; 33,706 parameters; training steps: BPTT fine-tuning 525 (unrolled over
    T=2, 4, 8)"``."""
    settings = meta.get("settings") or {}
    budget = settings.get("budget") or {}
    prepared = next((s.get("changes") or {} for s in meta.get("stages", []) if s.get("name") == "prepare"), {})
    parts = []
    if isinstance(budget.get("total_seconds"), (int, float)):
        parts.append(f"{duration(budget['total_seconds'])} on {settings.get('device', 'cpu')}")
    if prepared.get("parameters"):
        parts.append(f"{prepared['parameters']:,} parameters")
    unrolled = _horizons(settings.get("finetune") or {}, budget.get("finetune_T"))
    steps = [f"{label} {budget[key]:,}" + (f" (unrolled over T={unrolled})" if key == "finetune_steps_run"
                                            and unrolled else "")
             for key, label in (("qcfs_steps_run", "QCFS training"),
                                ("reconstruction_steps_run", "reconstruction"),
                                ("finetune_steps_run", "BPTT fine-tuning")) if budget.get(key)]
    parts.append("training steps: " + ", ".join(steps) if steps else "no training steps")
    return "; ".join(parts)


def headline(run: Mapping[str, Any]) -> list[str]:
    """The report's opening sentences (plain text): what was converted, at what T, ANN -> SNN
    accuracy with the number of test images, and what the conversion cost; then what
    fine-tuning changed."""
    meta, ft = run.get("meta"), run.get("finetune")
    lines = []
    if meta:
        settings, acc = meta.get("settings") or {}, meta.get("accuracy") or {}
        T = settings.get("T")
        data = f" on {settings['data']}" if settings.get("data") else ""
        snn = (acc.get("snn") or {}).get(str(T))
        if isinstance(acc.get("ann"), (int, float)) and isinstance(snn, (int, float)):
            n = settings.get("eval_images")
            on = f"on {n:,} test images" if isinstance(n, int) else "on the evaluation data (image count not recorded)"
            lines.append(f"{_model_name(meta)}{data}, converted to a spiking network at T={T}: "
                         f"ANN {acc['ann']:.2f}% \u2192 SNN {snn:.2f}% {on}.")
        else:
            lines.append(f"{_model_name(meta)}{data}, converted to a spiking network at T={T} (no "
                         "accuracies: convert ran without evaluation data).")
        lines.append(f"Conversion cost: {_cost(meta)}.")
        above = beyond_ann(meta)
        if above:
            lines.append(f"Fine-tuning trained the SNN beyond its ANN: {above['snn']:.2f}% against "
                         f"{above['ann']:.2f}% on {above['data']}; the SNN is a further-trained network.")
    exit_ = (run.get("evaluation") or {}).get("early_exit")
    if exit_:
        lines.append(f"With early exit ({ExitRule.from_dict(exit_['rule']).describe()}): {exit_['accuracy']:.2f}% "
                     f"at a mean of {exit_['mean_steps']:.2f} of {exit_['T']} steps per image, against "
                     f"{exit_['accuracy_fixed_T']:.2f}% at all {exit_['T']}, on {_images(exit_.get('images'))} "
                     "test images.")
    if ft and (ft.get("accuracy") or {}).get("snn"):
        tuned = ft["accuracy"]["snn"]
        t = str(ft.get("T")) if str(ft.get("T")) in tuned else max(tuned, key=int)
        lines.append(f"After snnconv finetune (trained for T={ft.get('T')}, {ft.get('epochs')} epoch(s)): "
                     f"SNN {tuned[t]:.2f}% at T={t} on {_images(ft.get('images'))} test images.")
    if not lines:
        lines.append("No conversion record (meta.json): the sections below show what the run folder holds.")
    return lines


def _backend_rows(backends: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(label, record)`` per backend file, by backend, T and image count."""
    rows = []
    for stem, res in backends.items():
        settings = res.get("settings") or {}
        inner = [str(res.get("data", "data not recorded"))] + \
            [f"{k}={v}" for k, v in settings.items() if k != "early_exit"] + \
            (["early exit"] if res.get("early_exit") else [])
        label = f"{res.get('backend', stem)} ({', '.join(inner)})"
        rows.append((label, res))
    return sorted(rows, key=lambda r: (str(r[1].get("backend", "")), r[1].get("T") or 0,
                                       r[1].get("images") or 0, r[0]))


def _accuracy_section(run: Mapping[str, Any], parts: list[str]) -> None:
    meta, ft, ev = run["meta"], run["finetune"], run["evaluation"]
    settings = (meta or {}).get("settings") or {}
    acc = (meta or {}).get("accuracy") or {}
    n = settings.get("eval_images")
    evaluated = None  # snnconv evaluate's sweep of the converted network, where it adds a T
    if ev and ev.get("accuracy") and not acc.get("snn"):
        acc, n = {**acc, "snn": ev["accuracy"]}, ev.get("images")
    elif ev and ev.get("accuracy") and ev.get("network", "snn.pt") == "snn.pt" and \
            set(map(str, ev["accuracy"])) - set(map(str, acc["snn"])):
        evaluated = (f"SNN (snnconv evaluate, {_images(ev.get('images'))} images)", ev["accuracy"])
    tuned = (ft or {}).get("accuracy", {}).get("snn") if ft else None
    measured = [(label, res) for label, res in _backend_rows(run["backends"])  # at a fixed T (early exit: below)
                if isinstance(res.get("accuracy"), (int, float)) and res.get("T") and not res.get("early_exit")]
    parts.append("<h2>Accuracy against time steps</h2>")
    if not (acc.get("snn") or tuned or measured):
        parts.append(_note("No accuracies: meta.json (snnconv convert with evaluation data) is absent."))
        return
    counts = [c for c in [n, (ft or {}).get("images")] + [r.get("images") for _, r in measured]
              if isinstance(c, int)]
    largest = max(counts, default=0)
    shown = [(f"{label}, {_images(r.get('images'))}" + (f" of {largest:,} images (a subset)"
                                                       if _subset(r.get("images"), largest) else " images"),
              int(r["T"]), float(r["accuracy"])) for label, r in measured if not few_images(r.get("images"), largest)]
    left = [f"{label} at T={r['T']}: {r['accuracy']:.2f}% on {_images(r.get('images'))} images"
            for label, r in measured if few_images(r.get("images"), largest)]
    parts.append(_img(_png(lambda ax: draw_accuracy(ax, acc, tuned, shown, evaluated), size=(8.4, 3.8)),
                      "accuracy vs T"))
    if left:
        parts.append(_note(f"Left off the plot (fewer than {FEW_IMAGES} images, against {largest:,} "
                           f"for the others): {'; '.join(left)}. They are in the table."))
    rows = [[label, "analog", _images(n), acc[key]] for key, label in (
        ("ann", "ANN"), ("folded", "ANN, BatchNorm folded"), ("qcfs", f"QCFS-ANN (L={settings.get('L', '?')})"))
        if isinstance(acc.get(key), (int, float))]
    rows += [["SNN (converted)", t, _images(n), v] for t, v in zip(*curve_points(acc.get("snn") or {}))]
    if evaluated:
        rows += [["SNN (snnconv evaluate)", t, _images(ev.get("images")), v]
                 for t, v in zip(*curve_points(evaluated[1]))]
    rows += [["SNN (snnconv finetune)", t, _images((ft or {}).get("images")), v]
             for t, v in zip(*curve_points(tuned or {}))]
    rows += [[f"backend {label}" + (" (few images)" if few_images(r.get("images"), largest) else
                                    _subset(r.get("images"), largest)),
              r["T"], _images(r.get("images")), r["accuracy"]] for label, r in measured]
    parts.append(_table(["network", "T", "test images", "accuracy (%)"], rows))
    T = settings.get("T")
    if T and len(acc.get("snn") or {}) > 1:
        parts.append(f"<p class='meta'>The converted network was calibrated (and fine-tuned) for T={T}; at "
                     "other T it is the same network run for more or fewer steps, not a conversion made for "
                     "that T. For the curve of conversions made for each T, convert at each T (snnconv "
                     "diagnose --needed-T measures the plain conversion's).</p>")


def _diagnosis_section(diag: Mapping[str, Any] | None, parts: list[str]) -> None:
    """Where the accuracy goes (``snnconv diagnose``): the summary, the plot, the main layers. A
    diagnosis.json that is no such record (read as data) gives a note instead."""
    if not diag:
        return
    section: list[str] = []
    try:
        _diagnosis_parts(diag, section)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        section = ["<h2>Where the accuracy goes</h2>",
                   _note(f"diagnosis.json is not a record of snnconv diagnose ({type(exc).__name__}: "
                         f"{str(exc)[:120]}); run snnconv diagnose again")]
    parts.extend(section)


def _diagnosis_parts(diag: Mapping[str, Any], parts: list[str]) -> None:
    from snnconv.analysis.diagnosis import Diagnosis
    from snnconv.analysis.plots import draw_diagnosis

    d = Diagnosis.from_dict({k: v for k, v in diag.items() if k not in ("network", "run_id")})
    parts.append(f"<h2>Where the accuracy goes ({html.escape(str(diag.get('network', 'the SNN')))}, "
                 f"T={d.T}, {d.images} test images)</h2>")
    parts.append("".join(f"<p>{html.escape(line)}</p>" for line in d.summary(top=0).splitlines()))
    by = {layer.name: layer for layer in d.layers}
    rows = [[n, by[n].site or "", f"{by[n].departure:.2f}", *(f"{by[n].causes.get(c, 0):.2f}" for c in
            ("carried", "clip", "quantisation", "temporal")), f"{by[n].kl_recovered:.3f}", by[n].own]
            for n in d.ranking[:10]]

    def draw(_ax):
        fig = _ax.figure
        _ax.remove()
        draw_diagnosis(d, fig.subplots(2, 1, sharex=True))

    parts.append(_img(_png(draw, size=(9, 6)), "departure by cause, per IF layer"))
    parts.append(_table(["IF layer", "ANN site", "departure", "carried", "clip", "quantisation", "temporal",
                         "KL removed as ANN", "its own cause"], rows))


def _early_exit_section(run: Mapping[str, Any], parts: list[str]) -> None:
    """Accuracy against mean steps and the exit steps' histogram (``snnconv evaluate`` with a
    rule), and every early-exit run of a backend."""
    record = (run.get("evaluation") or {}).get("early_exit")
    ran = [(label, r) for label, r in _backend_rows(run["backends"]) if r.get("early_exit")]
    if not (record or ran):
        return
    parts.append("<h2>Early exit</h2>")
    rows = []
    if record:
        parts.append(_img(_png(lambda axes: draw_exit(record, axes), size=(10, 3.6), ncols=2),
                          "early exit: accuracy against mean steps, exit steps"))
        rows.append(["torch network (snnconv evaluate)", ExitRule.from_dict(record["rule"]).describe(),
                     record["T"], _images(record.get("images")), record["accuracy"], record["mean_steps"],
                     record["histogram"], "steps run"])
    for label, r in ran:
        e = r["early_exit"]
        rows.append([f"backend {label}", ExitRule.from_dict(e["rule"]).describe(), r.get("T", ""),
                     _images(r.get("images")), e.get("accuracy", math.nan), e.get("mean_steps", math.nan),
                     e.get("histogram", ""), {"dropped": "steps run", "to exit": "steps up to each exit"}.get(
                         e.get("counted") or ("dropped" if e.get("dropped") else ""), "all T steps")])
    parts.append(_table(["where", "rule", "T", "test images", "accuracy (%)", "mean steps",
                         "images exiting at step 1 .. T", "spikes and energy count"], rows))


def _evaluation_sections(ev: Mapping[str, Any] | None, parts: list[str]) -> Mapping[str, Any] | None:
    ev = ev or {}
    analysis = ev.get("analysis")
    at = (f" ({ev.get('network', 'the SNN')}, T={analysis['T']}, the first {analysis['batch']} test images)"
          if analysis else "")
    parts.append(f"<h2>Firing rate per layer{html.escape(at)}</h2>")
    if analysis and analysis.get("firing_rate"):
        parts.append(_img(_png(lambda ax: draw_firing(ax, analysis["firing_rate"]), size=(7.5, 3.8)),
                          "firing rate per layer"))
        mean = sum(analysis["firing_rate"].values()) / len(analysis["firing_rate"])
        parts.append(f"<p>Mean over layers: {100 * mean:.2f}% of neurons fire per step "
                     f"(T={analysis['T']}, {analysis['batch']} images).</p>")
    else:
        parts.append(_note("No spike statistics: evaluation.json (snnconv evaluate) is absent."))
    parts.append(f"<h2>Spike raster{html.escape(at)}</h2>")
    if analysis and analysis.get("raster"):
        per_layer = 64
        parts.append(_img(_png(lambda ax: draw_raster(ax, analysis["raster"], int(analysis["T"]), per_layer),
                               size=(7.5, 0.35 * len(analysis["raster"]) + 1.5)), "spike raster"))
    else:
        parts.append(_note("No spike raster: evaluation.json (snnconv evaluate) is absent."))
    parts.append(f"<h2>Synaptic operations and energy{html.escape(at)}</h2>")
    if analysis and analysis.get("macs"):
        parts.append(_img(_png(lambda ax: draw_ops(ax, analysis["synops"], analysis["macs"],
                                                 analysis.get("static_macs") or {}), size=(7.5, 3.8)),
                          "synaptic operations vs MACs"))
    else:
        parts.append(_note("No operation counts: evaluation.json (snnconv evaluate) is absent."))
    return analysis


def _history(parts: list[str], history: list[Mapping[str, Any]], title: str) -> None:
    parts.append(f"<h3>{html.escape(title)}</h3>")
    parts.append(_img(_png(lambda ax: draw_history(ax, history, title.split(":")[0])), "fine-tuning curves"))
    parts.append(_table(["epoch", "steps", "loss", "train acc (%)", "val acc (%)", "seconds"],
                        [[h["epoch"], h.get("steps", ""), h.get("loss", math.nan), h.get("train_acc", math.nan),
                          h.get("val_acc", math.nan), h.get("seconds", math.nan)] for h in history]))


def _finetune_section(meta: Mapping[str, Any] | None, ft: Mapping[str, Any] | None, parts: list[str]) -> None:
    parts.append("<h2>Fine-tuning</h2>")
    stage = next((s for s in (meta or {}).get("stages", []) if s.get("name") == "finetune"), None) or {}
    recorded = [h for h in (stage.get("changes") or {}).get("history") or [] if "epoch" in h]
    if recorded:
        cfg = ((meta or {}).get("settings") or {}).get("finetune") or {}
        steps = sum(h.get("steps", 0) for h in recorded)
        _history(parts, recorded, f"BPTT in snnconv convert: {steps:,} steps unrolled over "
                                  f"T={_horizons(cfg) or '?'}; {len(recorded)} epoch(s), "
                                  f"{duration(stage.get('seconds', 0.0))}")
    ft = ft or {}
    history = [h for h in ft.get("history") or [] if "epoch" in h]
    if history:
        _history(parts, history, f"BPTT in snnconv finetune: trained for T={ft.get('T')}, "
                                 f"{len(history)} epoch(s)")
    if not recorded and not history:
        parts.append(_note("No fine-tuning: convert ran none (meta.json records no BPTT stage) and "
                           "finetune.json (snnconv finetune) is absent."))


def _backends_section(backends: Mapping[str, Mapping[str, Any]], parts: list[str]) -> None:
    parts.append("<h2>Backends</h2>")
    if not backends:
        parts.append(_note("No backend results: backends/*.json (snnconv run) are absent."))
        return
    rows = _backend_rows(backends)
    parts.append(_table(["backend (data, settings)", "T", "test images", "accuracy (%)",
                         "agreement with torch SNN (%)", "synaptic ops", "wall time (s)"],
                        [[label, r.get("T", ""), _images(r.get("images")), r.get("accuracy", math.nan),
                          r.get("agreement", math.nan), r.get("synops_total", math.nan), r.get("wall_s", math.nan)]
                         for label, r in rows]))
    notes = [f"<li><b>{html.escape(label)}</b>: {html.escape(str(r['note']))}</li>" for label, r in rows
             if r.get("note")]
    if notes:
        parts.append("<ul>" + "".join(notes) + "</ul>")


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, *,
                 title: str | None = None) -> str:
    """Write ``report.html`` for ``run_dir`` (or to ``out``) and return its path.

    Raises:
        DataError: see :func:`load_run`.
    """
    run_dir = os.fspath(run_dir)
    run = load_run(run_dir)
    meta, ft, ev, backends = run["meta"], run["finetune"], run["evaluation"], run["backends"]
    parts: list[str] = []
    title = title or f"snnconv run: {os.path.basename(os.path.abspath(run_dir))}"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env = (meta or {}).get("environment", {})
    settings = (meta or {}).get("settings", {})
    info = ", ".join(f"{k} {v}" for k, v in env.items() if k in ("snnconv", "torch", "python"))
    parts.append(f"<h1>{html.escape(title)}</h1>")
    parts.append("<div id='headline' class='headline'>" + "".join(f"<p>{html.escape(line)}</p>"
                                                                  for line in headline(run)) + "</div>")
    parts.append(f"<p class='meta'>generated {stamp} from {html.escape(os.path.abspath(run_dir))}"
                 f"{'; ' + html.escape(info) if info else ''}</p>")
    for what in run["left_out"]:
        parts.append(_note(f"Left out {what}: written by another run in the same folder."))
    if settings:
        keys = [k for k in ("model", "data", "T", "L", "per_channel", "qcfs_epochs", "finetune_epochs",
                            "bias_calibration", "membrane_calibration", "weight_calibration", "eval_images",
                            "device") if k in settings]
        parts.append(_table(["setting (snnconv convert)", "value"], [[k, settings[k]] for k in keys]))

    _accuracy_section(run, parts)
    _early_exit_section(run, parts)
    _diagnosis_section(run.get("diagnosis"), parts)
    T = settings.get("T")
    parts.append(f"<h2>Threshold distribution (the converted network{f', T={T}' if T else ''})</h2>")
    thetas = _thresholds(meta)
    if thetas:
        parts.append(_img(_png(lambda ax: draw_thresholds(ax, thetas), size=(7.5, 3.8)), "thresholds"))
    else:
        parts.append(_note("No thresholds: meta.json from snnconv convert is absent."))
    analysis = _evaluation_sections(ev, parts)
    _finetune_section(meta, ft, parts)
    _backends_section(backends, parts)
    _energy_section(analysis, backends, parts)

    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{_CSS}</style></head><body>{''.join(parts)}{_LOADED_SCRIPT}</body></html>\n")
    path = os.fspath(out) if out is not None else os.path.join(run_dir, REPORT_NAME)
    atomic_write_text(path, page)
    return path
