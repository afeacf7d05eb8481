"""Issue 53's item-6 table (markdown rows) from call c's and call d's load reports: each mode and engine at 0.5x,
1x and 2x capacity, this tree ("now") and the tree before (1266f61)."""
import json
import os
import sys

MODES = [("auto", "NIXL auto"), ("staged", "NIXL staged"), ("direct", "NIXL direct"),
         ("mc-staged", "Mooncake `nvlink_intra` staged")]
folders = sys.argv[1:]
for mode, title in MODES:
    for x in ("0.5", "1", "2"):
        for who in ("before", "now"):
            path = next((os.path.join(f, "j", f"{who}-{mode}-{x}x.json") for f in folders
                         if os.path.exists(os.path.join(f, "j", f"{who}-{mode}-{x}x.json"))), None)
            if path is None:
                continue
            r = json.load(open(path))
            lat, thr, caller = r.get("latency_ms", {}), r.get("throughput", {}), r.get("caller_us_per_request", {})
            dec = sorted(v for k, v in caller.items() if k.startswith("decode"))
            others = {k: v for k, v in r["failures"].items() if k != "overload"}
            print(f"| {title} | {x}x ({r['config']['rate']:.0f}/s) | {who} | {r['completed']:,}/{r['requests']:,} | "
                  f"{thr.get('requests_per_s', 0):,.0f} | {lat.get('p50', float('nan')):,.0f} | {lat.get('p99', float('nan')):,.0f} | "
                  f"{r['failures'].get('overload', 0):,}{' + ' + str(others) if others else ''} | "
                  f"{caller['prefill']:,.0f} | " if 'prefill' in caller else "| - | ", end="")
            print(f"{dec[0]:,.0f}-{dec[-1]:,.0f} |" if dec else "- |")
