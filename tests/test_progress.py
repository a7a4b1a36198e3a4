"""Progress display: one line per loop (at most one every LOG_INTERVAL s) when stderr is not a
terminal, a tqdm bar on a terminal, nothing when disabled; it never touches the RNG."""

from __future__ import annotations

import io
import re

import torch

from snnconv.progress import FIRST_LINE, LOG_INTERVAL, LogProgress, progress_bar


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_redirected_stream_gets_one_line_per_loop_not_one_per_update():
    out = io.StringIO()
    bar = progress_bar(range(5000), desc="QCFS epoch 1/2", file=out, leave=False)
    assert isinstance(bar, LogProgress) and bar.interval == LOG_INTERVAL >= 5
    for _ in bar:
        bar.set_postfix(loss="0.123")
    lines = out.getvalue().splitlines()
    assert len(lines) <= 2, lines  # the closing line (plus one if the loop outlasted the interval)
    assert lines[-1].startswith("QCFS epoch 1/2: 5000/5000") and "loss=0.123" in lines[-1]
    assert "\r" not in out.getvalue()


def test_manual_updates_write_at_most_one_line_per_interval():
    out = io.StringIO()
    bar = progress_bar(total=1000, desc="BPTT epoch 1/1", file=out, initial=10)
    for _ in range(990):
        bar.update(1)
    bar.close()
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith("BPTT epoch 1/1: 1000/1000")
    assert len(out.getvalue().splitlines()) <= 2


def test_a_terminal_gets_tqdm_and_disable_prints_nothing():
    from tqdm.auto import tqdm

    bar = progress_bar(range(3), file=_Tty(), desc="x")
    assert isinstance(bar, tqdm)
    bar.close()
    out = io.StringIO()
    quiet = progress_bar(range(3), file=out, disable=True)
    assert list(quiet) == [0, 1, 2] and out.getvalue() == ""


def test_progress_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    for _ in progress_bar(range(100), file=io.StringIO()):
        pass
    assert torch.equal(torch.get_rng_state(), state)


def test_a_line_of_a_running_loop_gives_the_time_left_where_the_total_is_known():
    out = io.StringIO()
    bar = LogProgress(total=10, desc="BPTT epoch 1/3", file=out, first=0.0)
    bar.update(4)  # the first line comes once `first` seconds have passed: at once here
    line = out.getvalue().splitlines()[0]
    assert re.fullmatch(r"BPTT epoch 1/3: 4/10 \[[\d.]+ s elapsed, about [\d.]+ s left\]", line), line
    bar.update(6)
    bar.close()
    assert "left" not in out.getvalue().splitlines()[-1]  # done: nothing left to estimate
    unknown = io.StringIO()
    bar = LogProgress(desc="stream", file=unknown, first=0.0)
    bar.update(3)
    assert re.fullmatch(r"stream: 3 \[[\d.]+ s elapsed\]", unknown.getvalue().splitlines()[0])
    assert FIRST_LINE <= 10 < LOG_INTERVAL  # a loop of a few seconds shows its estimate early
