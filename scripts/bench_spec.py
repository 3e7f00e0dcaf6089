"""Speculative decoding benchmark: a thin wrapper over `specdec bench` (every flag is its own; see
`specdec bench --help`).

    python scripts/bench_spec.py --target DIR [--k 2,4,8] [--max-new-tokens 128] [--out bench.json]
"""

import sys

from specdec.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["bench"]
    main()
