"""One line per kvplan load JSON report: offered and completed rates, p50/p99, failures by cause, caller us/request,
then where a completed request's time went (p50 of each phase)."""
import json
import sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    c = r["config"]
    lat = r.get("latency_ms", {})
    thr = r.get("throughput", {})
    print(f"{path.split('/')[-1]:30s} offered {c['rate']:>7g}/s  requests {r['requests']:>6}  completed {r['completed']:>6} "
          f"({thr.get('requests_per_s', 0):.0f}/s)  p50 {lat.get('p50', float('nan')):.1f} ms  p99 {lat.get('p99', float('nan')):.1f} ms  "
          f"failures {r['failures']}  caller_us {r.get('caller_us_per_request', {})}  problems {len(r.get('problems', []))}")
    phases = r.get("phases_ms", {})
    if phases:
        print(" " * 31 + "phases p50/p99 ms: " + ", ".join(f"{k} {v['p50']:.1f}/{v['p99']:.1f}" for k, v in phases.items()))
    for p in r.get("problems", [])[:2]:
        print(" " * 31 + "problem: " + p[:200])
