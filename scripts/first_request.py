"""Time a fresh server's first requests (device check of the replica warm-up): POSTs a few
/v1/completions of `--input-len` random token ids, one at a time, and prints each latency."""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8100")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        with urllib.request.urlopen(args.url + "/v1/models", timeout=30) as resp:
            args.model = json.load(resp)["data"][0]["id"]
    rng = random.Random(7)
    for i in range(args.requests):
        body = {"model": args.model, "prompt": [rng.randrange(10, 30000) for _ in range(args.input_len)],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(args.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
        print(f"request {i}: {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
