"""Where a profiled step's GPU sits idle: gaps between consecutive kernels in a Chrome trace
(moe_layer.py --trace-dir), largest first, with the kernels on either side.

    python benchmarks/trace_gaps.py TRACE.json [--min-us 20] [--top 15]
"""

import argparse
import json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    gaps, busy = [], 0.0
    for a, b in zip(gpu, gpu[1:]):
        busy += a["dur"]
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap >= args.min_us:
            gaps.append((gap, a["name"][:60], b["name"][:60], a["ts"] + a["dur"] - gpu[0]["ts"]))
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    print(f"{len(gpu)} GPU events over {span / 1e3:.2f} ms, busy {(busy + gpu[-1]['dur']) / 1e3:.2f} ms, "
          f"{len(gaps)} gaps >= {args.min_us:.0f} us totalling {sum(g[0] for g in gaps) / 1e3:.2f} ms")
    for gap, before, after, at in sorted(gaps, reverse=True)[:args.top]:
        print(f"  {gap:8.1f} us at {at / 1e3:7.2f} ms: after {before} | before {after}")


if __name__ == "__main__":
    main()
