"""What a run cut by its time limit leaves for the next: the tests it was still in, and the order a resumed run
takes its tests in.

A cut run's slowest tests are the ones it was still in: each resume started them again from nothing, late,
behind the quick ones, and lost them again at the next cut. So:

- `record_cut(OUTCOMES)` adds a line per test still running (`OUTCOMES.running`, which the plugin keeps) to the
  --outcomes file: outcome "cut", `seconds` how long it had run — a verdict of nothing (`finished_tests` runs
  it again), a lower bound of its duration;
- `pytest --resume OUTCOMES` starts the tests whose recorded time is long (`SLOW_S` or more: cut, or finished
  and failed) first, the longest first, one per pytest-xdist worker: under `--dist worksteal` each worker's
  first tests (the scheduler hands the workers contiguous, equal blocks of the list), under `--dist load` the
  head of the list (handed out in turn).

    python -m harness.testing.resume cut OUTCOMES   # after a time limit stopped `pytest --outcomes OUTCOMES`
"""
from __future__ import annotations

import json
import os
import sys
import time

SLOW_S = 30.0  # a recorded time from which a test is started first on a resume
CUT_WHY = "still running when the run was cut"
# how a passed test's outcome line starts when `pytest --generate-seconds` ended its drawing (the report lists them)
CAPPED_WHY = "--generate-seconds: "


def record_cut(outcomes: str, now: float | None = None) -> list[str]:
    """Append an outcome line "cut" for each test in `outcomes`.running (then removed: the lines say it now);
    the node ids, longest first. Nothing when there is no such file."""
    running = f"{outcomes}.running"
    if not os.path.isfile(running):
        return []
    try:
        with open(running) as f:
            started = json.load(f)
    except ValueError:  # written whole and renamed into place: only a foreign file reads wrong
        started = {}
    now = time.time() if now is None else now
    lines = sorted(({"nodeid": n, "when": "cut", "outcome": "cut", "seconds": round(max(0.0, now - t), 1),
                     "why": CUT_WHY, "at": round(now, 1)} for n, t in started.items()),
                   key=lambda x: -x["seconds"])
    with open(outcomes, "a") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    os.remove(running)
    return [x["nodeid"] for x in lines]


def outcome_lines(paths):
    """The lines of --outcomes files, read in order, as dicts (a line cut by a time limit is passed over)."""
    for path in paths:
        with open(path) as f:
            for ln in f:
                try:
                    yield json.loads(ln)
                except ValueError:
                    continue


def recorded_seconds(records) -> dict[str, float]:
    """node id -> the seconds of its latest outcome line (`records`: the lines, as `outcome_lines` reads them)
    that has them (a cut line's: how long it had run)."""
    return {rec["nodeid"]: float(rec["seconds"]) for rec in records
            if isinstance(rec.get("seconds"), (int, float)) and "nodeid" in rec}


def worksteal_blocks(n_items: int, workers: int) -> list[int]:
    """The sizes of the contiguous blocks pytest-xdist's worksteal scheduler first hands its `workers` workers
    (each takes what is left divided by the workers still to serve)."""
    sizes, left = [], n_items
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def resume_order(ids: list[str], seconds: dict[str, float], workers: int = 1, dist: str = "load",
                 slow_s: float = SLOW_S) -> list[str]:
    """`ids` with the slow ones (recorded `slow_s` or more) first, the longest first: with `dist` "worksteal"
    and several workers, at the heads of the blocks the workers are first handed (the slow ones dealt in turn);
    otherwise at the head of the list. The others keep their order."""
    slow = sorted((i for i in ids if seconds.get(i, 0.0) >= slow_s), key=lambda i: -seconds[i])
    if not slow:
        return list(ids)
    chosen = set(slow)
    rest = [i for i in ids if i not in chosen]
    if dist != "worksteal" or workers <= 1:
        return slow + rest
    blocks = [slow[w::workers] for w in range(workers)]
    it = iter(rest)
    for block, size in zip(blocks, worksteal_blocks(len(ids), workers)):
        while len(block) < size:
            nxt = next(it, None)
            if nxt is None:
                break
            block.append(nxt)
    return [i for b in blocks for i in b] + list(it)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "cut":
        print("usage: python -m harness.testing.resume cut OUTCOMES", file=sys.stderr)
        return 2
    if not os.path.isfile(argv[1]):
        print(f"harness.testing.resume: OUTCOMES: expected an --outcomes file, got {argv[1]!r} (no such file)",
              file=sys.stderr)
        return 2
    cut = record_cut(argv[1])
    print(f"{len(cut)} test(s) recorded as cut" + (f": {', '.join(cut)}" if cut else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
