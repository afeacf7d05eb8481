"""One line per kvplan load JSON report: offered and completed rates, p50/p99, failures by cause, caller us/request."""
import json
import sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    c = r["config"]
    lat = r.get("latency_ms", {})
    thr = r.get("throughput", {})
    print(f"{path.split('/')[-1]:28s} offered {c['rate']:>7g}/s  requests {r['requests']:>6}  completed {r['completed']:>6} "
          f"({thr.get('requests_per_s', 0):.0f}/s)  p50 {lat.get('p50', float('nan')):.1f} ms  p99 {lat.get('p99', float('nan')):.1f} ms  "
          f"failures {r['failures']}  caller_us {r.get('caller_us_per_request', {})}  problems {len(r.get('problems', []))}")
