"""Silent waits of real commands (issue 22, item 8).

    python -m benchmarks.bench_waits --out DIR [--quick]

Runs ``fullece extract`` (top-k and full store) of a tiny GPT-2 the script
builds, then ``aggregate``, ``metrics``, ``temperature`` and ``report`` of
those runs, each as a fresh subprocess whose standard error is a terminal (a
pty, as a user at a shell sees it: tqdm bars redraw there). Every write to
the terminal is timestamped (a carriage return or newline ends an update), and
for each command the script prints the longest gap between two updates (the
start of the process and its exit count as updates), what was on the screen
during it, and every gap over 2 s. Writes DIR/waits.json.

A gap after a notice (``fullece: loading ...``) is announced; a gap anywhere
else (before the first output, a bar sitting at 0%, after a bar closed) is a
silent wait. No figure here is a pass/fail threshold: these are measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.processes import timed_process_env

SILENT_S = 2.0
NOTICE_PREFIX = "fullece: "


def _fullece() -> str:
    exe = Path(sys.executable).with_name("fullece")
    return str(exe) if exe.exists() else shutil.which("fullece") or "fullece"


def _set_terminal(fd: int, cols: int = 120) -> None:
    """A 120-column terminal that passes "\n" as written (no "\r\n")."""
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    attrs = termios.tcgetattr(fd)
    attrs[1] &= ~termios.ONLCR
    termios.tcsetattr(fd, termios.TCSANOW, attrs)


def timestamped_stderr(argv: list[str], env: dict | None = None, cwd=None) -> dict:
    """Run `argv` with standard error on a pty; returns {rc, wall_s, updates:
    [(seconds since start, text on screen)]}: one update per line a write
    ended, and one for the line a write left on screen (tqdm writes "\r" then
    the bar, so a bar shows before its line ends). A line cleared by a closing
    bar (leave=False) shows the last line written before it."""
    import re

    master, slave = pty.openpty()
    _set_terminal(slave)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL, env=env, cwd=cwd
    )
    os.close(slave)
    updates, line, last_line = [], "", ""
    shown = None  # the unfinished line already recorded as on screen, if any
    while True:
        ready, _, _ = select.select([master], [], [], 0.05)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536).decode(errors="replace")
        except OSError:  # the child closed its end
            data = ""
        if not data:
            break
        now = round(time.perf_counter() - t0, 3)
        before, ended_shown = len(updates), False
        for part in re.split(r"([\r\n])", data):
            if part == "\n":
                if line.strip():
                    last_line = _clean(line)
                    if line != shown:
                        updates.append((now, last_line))
                    else:  # ending a line already on screen changes nothing
                        ended_shown = True
                line, shown = "", None
            elif part == "\r":
                line, shown = "", None
            else:
                line += part
        if line.strip() or (len(updates) == before and not ended_shown):  # a bar, a line cleared
            updates.append((now, _clean(line) if line.strip() else last_line))
            shown = line if line.strip() else None
    rc = proc.wait()
    wall = time.perf_counter() - t0
    os.close(master)
    return {"rc": rc, "wall_s": round(wall, 3), "updates": [u for u in updates if u[1]]}


def _clean(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).strip()


def gaps(run: dict) -> list[dict]:
    """Every interval between two updates (start and exit included), with the
    text shown during it and whether a notice announced it."""
    times = [(0.0, "<start: nothing shown yet>"), *run["updates"], (run["wall_s"], "<exit>")]
    out = []
    for (t_a, text), (t_b, _) in zip(times, times[1:], strict=False):
        out.append(
            {
                "from_s": t_a,
                "seconds": round(t_b - t_a, 3),
                "showing": text,
                "announced": text.startswith(NOTICE_PREFIX) and text.rstrip().endswith("..."),
            }
        )
    return out


def summarize(name: str, run: dict) -> dict:
    every = gaps(run)
    longest = max(every, key=lambda g: g["seconds"])
    silent = [g for g in every if not g["announced"]]
    longest_silent = max(silent, key=lambda g: g["seconds"]) if silent else None
    return {
        "command": name,
        "rc": run["rc"],
        "wall_s": run["wall_s"],
        "updates": len(run["updates"]),
        "longest_gap": longest,
        "longest_silent_gap": longest_silent,
        "gaps_over_2s": [g for g in every if g["seconds"] > SILENT_S],
        "notices": [t for _, t in run["updates"] if t.startswith(NOTICE_PREFIX)],
    }


def _print(summary: dict) -> None:
    g, s = summary["longest_gap"], summary["longest_silent_gap"]
    print(
        f"{summary['command']:<24} rc {summary['rc']:>3}  wall {summary['wall_s']:6.2f} s  "
        f"longest gap {g['seconds']:5.2f} s  longest silent {s['seconds'] if s else 0:5.2f} s"
    )
    for gap in summary["gaps_over_2s"]:
        tag = "announced" if gap["announced"] else "SILENT"
        print(
            f"    {gap['seconds']:5.2f} s at {gap['from_s']:6.2f} s  [{tag}]  {gap['showing'][:90]}"
        )


def build_inputs(work: Path, docs: int) -> tuple[Path, Path]:
    from tests.helpers.extract_models import build_gpt2, synthetic_texts, write_corpus

    model = build_gpt2(work / "gpt2", n_positions=128)
    corpus = write_corpus(work / "corpus.txt", synthetic_texts(docs, seed=3, max_words=60))
    return model, corpus


def commands(work: Path, model: Path, corpus: Path) -> list[tuple[str, list[str]]]:
    fullece = _fullece()
    common = ["--model", str(model), "--corpus", str(corpus), "--device", "cpu"]
    common += ["--k", "16", "--max-length", "64", "--shard-positions", "4000"]
    topk, full = work / "run_topk", work / "run_full"
    return [
        ("extract topk", [fullece, "extract", *common, "--out", str(topk)]),
        ("extract full", [fullece, "extract", *common, "--store", "full", "--out", str(full)]),
        ("aggregate (first)", [fullece, "aggregate", str(topk)]),
        ("metrics", [fullece, "metrics", str(full)]),
        ("temperature", [fullece, "temperature", str(full)]),
        ("report", [fullece, "report", str(topk), "--out", str(work / "report")]),
    ]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="a smaller corpus")
    parser.add_argument("--docs", type=int, default=None)
    args = parser.parse_args(argv)
    docs = args.docs or (200 if args.quick else 1500)
    env = timed_process_env()
    env.pop("FULLECE_PROGRESS", None)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_waits_") as tmp:
        work = Path(tmp)
        model, corpus = build_inputs(work, docs)
        print(f"bench_waits: {docs} documents; stderr on a pty; gaps over {SILENT_S} s listed")
        for name, argv_ in commands(work, model, corpus):
            summary = summarize(name, timestamped_stderr(argv_, env=env))
            _print(summary)
            results.append(summary)
    report = {
        "docs": docs,
        "silent_threshold_s": SILENT_S,
        "commands": results,
        "longest_silent_gap_s": max(
            (r["longest_silent_gap"]["seconds"] for r in results if r["longest_silent_gap"]),
            default=0.0,
        ),
    }
    print(f"longest silent gap over all commands: {report['longest_silent_gap_s']:.2f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "waits.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
