"""Progress display: one line per loop (at most one every LOG_INTERVAL s) when stderr is not a
terminal, a tqdm bar on a terminal, nothing when disabled; it never touches the RNG."""

from __future__ import annotations

import io

import torch

from snnconv.progress import LOG_INTERVAL, LogProgress, progress_bar


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


def test_a_log_line_before_the_end_says_the_time_left_from_the_rate_so_far():
    out = io.StringIO()
    bar = progress_bar(total=10, desc="reconstruction", file=out, interval=0.0)
    bar.start -= 20.0  # 20 s ago: two steps at 10 s each, eight left
    bar.update(2)
    bar.close()
    first, last = out.getvalue().splitlines()[0], out.getvalue().splitlines()[-1]
    assert first.startswith("reconstruction: 2/10 [20s, ~80s left]"), first
    assert "left" not in last  # the closing line says what it took
