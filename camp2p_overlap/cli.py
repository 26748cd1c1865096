"""``camp2p-overlap`` command line (bench, doctor, sweep)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from camp2p_overlap.bench.cli import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
