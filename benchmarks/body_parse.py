"""How long the API server's worker thread holds the GIL parsing one big request body.

    python benchmarks/body_parse.py                   # a 7.5 MiB text prompt, best of 5
    python benchmarks/body_parse.py --mib 2 --repeats 9

Times ``pagectl.server.body._parse`` (JSON decode, then the int64 / lone-surrogate walk) on
a completions body holding a prompt of ``--mib`` MiB of text, through the msgspec path that
bodies of ``FAST_PARSE_BYTES`` or more take, and through ``json`` alone (the path before
it), with the ratio, and the part of either that is the int64 / surrogate check. Both hold the GIL for their whole run: this is how long every other
thread of the API process (the event loop included) waits.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pagectl.server import body, json_fields
from pagectl.server.field_checks import check_body


def best(fn, raw: bytes, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(raw)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=7.5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    words = "def add(a, b):\n    return a + b  # caf\u00e9\n"
    prompt = (words * (int(args.mib * 2**20) // len(words) + 1))[: int(args.mib * 2**20)]
    body_obj = {"model": "m", "prompt": prompt, "max_tokens": 16}
    raw = json.dumps(body_obj, ensure_ascii=False).encode()
    fast = best(body._parse, raw, args.repeats)
    obj = json.loads(raw)
    check = best(lambda r: check_body(obj, r), raw, args.repeats)
    limit = json_fields.FAST_PARSE_BYTES
    json_fields.FAST_PARSE_BYTES = 1 << 62  # the json path, as before
    try:
        slow = best(body._parse, raw, args.repeats)
    finally:
        json_fields.FAST_PARSE_BYTES = limit
    print(
        json.dumps(
            {
                "body_mib": round(len(raw) / 2**20, 2),
                "msgspec_ms": round(fast * 1000, 1),
                "json_ms": round(slow * 1000, 1),
                "of_which_check_ms": round(check * 1000, 1),
                "speedup": round(slow / fast, 2),
                "load": os.getloadavg(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
