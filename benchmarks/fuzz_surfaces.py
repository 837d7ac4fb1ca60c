"""Generated hostile cases against every RPC and frame type of one server: a table of outcomes per surface.

    .venv/bin/python benchmarks/fuzz_surfaces.py --cases 10000 [--surface publish ...] [--seed N]

Each surface (tests/support/surfaces.py) gets --cases cases from hypothesis, sent one at a time to
a server in this process on 127.0.0.1 (with a data port and publishing on). A case that breaks a
property (an outcome outside the surface's allowed set, bytes that fail their CRC32C or are not the
revision's, a bad publish taken, a good one refused) counts as a failure, and the run goes on; the
first few are printed. After each surface a good client must still load a good model bit for bit,
over gRPC and the data port. The table gives, per surface: cases, seconds, milliseconds per case,
the outcomes seen with their counts, and failures. Exit status 1 when any case failed.

The tests (tests/e2e/test_properties.py) run the same surfaces with a few dozen cases each.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.surfaces import SURFACES, Surface, Target, target_at


@dataclass
class Tally:
    cases: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


def run_surface(target: Target, surface: Surface, cases: int, random_seed: int) -> Tally:
    """cases of surface against target; every failure recorded, none raised."""
    tally = Tally()

    @seed(random_seed)
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # a failure is counted, not shrunk: the run goes on
        suppress_health_check=list(HealthCheck),
    )
    @given(surface.cases)
    def one(case: Any) -> None:
        tally.cases += 1
        try:
            tally.outcomes[surface.run(target, case)] += 1
        except Exception as exc:
            tally.outcomes["FAILED"] += 1
            tally.failures.append(f"{case!r}\n    {type(exc).__name__}: {str(exc)[:400]}")

    started = time.perf_counter()
    one()
    try:
        target.check_good_load()
    except Exception:
        tally.failures.append("good load afterwards:\n" + traceback.format_exc())
    tally.seconds = time.perf_counter() - started
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000, help="cases per surface (default 10000)")
    parser.add_argument("--surface", action="append", choices=sorted(SURFACES), help="only these (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis's random seed")
    parser.add_argument("--show", type=int, default=3, help="failures printed per surface")
    args = parser.parse_args(argv)
    # Every refusal logs a line on the server: thousands of them would bury the table.
    logging.disable(logging.WARNING)
    names = args.surface or list(SURFACES)
    tallies: dict[str, Tally] = {}
    with tempfile.TemporaryDirectory(prefix="fuzz-surfaces-") as folder, target_at(Path(folder)) as target:
        for name in names:
            tally = run_surface(target, SURFACES[name], args.cases, args.seed)
            tallies[name] = tally
            print(f"{name}: {tally.cases} cases in {tally.seconds:.1f} s", file=sys.stderr, flush=True)
    print(f"{'surface':<15} {'cases':>7} {'seconds':>8} {'ms/case':>8} {'failures':>8}  outcomes")
    for name, tally in tallies.items():
        per_case = 1000 * tally.seconds / tally.cases if tally.cases else 0.0
        seen = ", ".join(f"{code} {count}" for code, count in tally.outcomes.most_common())
        print(f"{name:<15} {tally.cases:>7} {tally.seconds:>8.1f} {per_case:>8.2f} {len(tally.failures):>8}  {seen}")
    for name, tally in tallies.items():
        for failure in tally.failures[: args.show]:
            print(f"\n{name} FAILED: {failure}")
    return 1 if any(t.failures for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
