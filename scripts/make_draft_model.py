"""Write a draft model for speculative decoding: the first N decoder layers of a model
(by default the built-in one), with its tokenizer.

    PYTHONPATH=$PWD python3 scripts/make_draft_model.py OUT_DIR [--layers 2] [--model DIR]

Then ``--speculative-config '{"method": "draft_model", "model": "OUT_DIR",
"num_speculative_tokens": 4}'``. benchmarks/speculative.py builds one itself.
"""

from __future__ import annotations

import argparse
import sys

from pagectl.engine.builder import resolve_model
from pagectl.testing.truncated_draft import write_truncated_draft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="directory to write")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers kept (default 2)")
    ap.add_argument("--model", default=None, help="source model directory (default: built-in)")
    a = ap.parse_args()
    out = write_truncated_draft(resolve_model(a.model), a.out, a.layers)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
