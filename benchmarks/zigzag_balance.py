"""Per-device causal indexer work (query-key scores) under the sequential and zigzag CP splits.

python -m benchmarks.zigzag_balance [--tokens 131072]
"""

from __future__ import annotations

import argparse

from benchmarks.common import report
from sharding.zigzag import causal_work


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    rows = []
    for cp in (2, 4, 8):
        for layout in ("sequential", "zigzag"):
            work = causal_work(args.tokens, cp, layout)
            rows.append({
                "cp": cp, "layout": layout, "per-device scores (x1e6)": " ".join(f"{w / 1e6:,.0f}" for w in work),
                "max / min": f"{work.max() / work.min():.3f}", "max / mean": f"{work.max() / work.mean():.3f}",
            })  # fmt: skip
    title = f"Causal indexer work per CP device, {args.tokens} tokens (counted, not timed)"
    report("zigzag_balance.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
