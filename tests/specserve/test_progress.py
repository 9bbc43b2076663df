"""Progress off a terminal (specserve/progress.py): where tqdm draws no bar (a pipe, a CI log), a plain line at
most every few seconds and one at the end; the bench's run shows it (issue #45: its bar appeared only on a
terminal, so a piped bench was silent for minutes)."""

from __future__ import annotations

import io

from specserve.progress import Heartbeat, Progress


def test_off_a_terminal_progress_is_a_line_every_few_seconds():
    out = io.StringIO()  # not a terminal
    p = Progress(3, "specserve bench", "run", stream=out, every_s=0.0)
    p.update("target-only")
    p.update()
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("specserve bench: 1/3 runs, target-only, ") and lines[0].endswith(" s")
    assert lines[1].startswith("specserve bench: 2/3 runs, target-only, ")
    assert len(lines) == 3  # and one at close

    out = io.StringIO()
    p = Progress(3, "x", "run", stream=out, every_s=3600.0)
    for _ in range(3):
        p.update()
    p.close()
    (line,) = out.getvalue().splitlines()  # only the one at close
    assert line.startswith("x: 3/3 runs, ")

    out = io.StringIO()
    p = Progress(3, "x", "run", stream=out, every_s=0.0, enabled=False)  # --quiet
    p.update()
    p.close()
    assert out.getvalue() == ""


def test_a_heartbeat_says_what_is_awaited_at_most_every_few_seconds():
    said: list[str] = []
    beat = Heartbeat(said.append, every_s=0.0)
    beat.beat("serve: waiting for the target")
    assert len(said) == 1 and said[0].startswith("serve: waiting for the target (") and said[0].endswith(" s)")
    slow = Heartbeat(said.append, every_s=3600.0)
    slow.beat("never")
    assert len(said) == 1


def test_the_bench_shows_progress_off_a_terminal(bench_target, tmp_path, capsys):
    """A short run (seconds): its closing line at least; a long one a line every 5 s as well."""
    from specserve.cli.main import main

    rc = main(
        [
            "bench",
            "--model",
            str(bench_target),
            "--drafters",
            "none",
            "--max-new-tokens",
            "4",
            "--prompts",
            "2",
            "--no-hf",
            "--k-sweep",
            "0",
            "--tax-context",
            "16",
            "--tax-repeats",
            "1",
            "--warmup",
            "0",
            "--bandwidth-mib",
            "1",
            "--num-kv-blocks",
            "64",
            "--kv-block-size",
            "8",
            "--no-plots",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert rc == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("specserve bench: ")]
    assert lines and lines[-1].startswith("specserve bench: 3/3 runs"), lines
