"""Where a staged batch's time goes, from a `kvplan load` log run with KVPLAN_TRACE=1: the prefill's runs (one
"staged waves" line each: the send's first steps, then each wave's) and the decodes' waves ("decode waves"),
all on one clock (CLOCK_MONOTONIC). Prints p50/p90 of each step to the next, per side, and the prefill's gap
between the end of one run and the start of the next."""
import ast
import collections
import re
import statistics
import sys

runs, decode = [], collections.defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        m = re.search(r"staged waves \(wave, step, clock ms\): (\[.*\])", line)
        if m:
            runs.append(ast.literal_eval(m.group(1)))
        m = re.search(r"decode waves \(wave, step, clock ms\): (\[.*\])", line)
        if m:
            for wave, step, t in ast.literal_eval(m.group(1)):
                decode[wave].append((step, t))


def show(title, spans):
    print(title)
    for key, values in sorted(((k, v) for k, v in spans.items() if v), key=lambda kv: -sum(kv[1])):
        values = sorted(values)
        print(f"  {key:28s} n {len(values):6d}  p50 {values[len(values) // 2]:8.3f}  p90 {values[int(len(values) * .9)]:8.3f}"
              f"  sum {sum(values):9.1f} ms")


spans, whole, gaps, waves_of = collections.defaultdict(list), [], [], {}
ends = []
for run in runs:
    first = [(k, t) for w, k, t in run if w == run[0][0]][:]  # the send's steps (wave id of the first)
    steps = sorted(((w, k, t) for w, k, t in run), key=lambda x: x[2])
    for (w0, k0, t0), (w1, k1, t1) in zip(steps, steps[1:]):
        spans[f"{k0}->{k1}"].append(t1 - t0)
    whole.append(steps[-1][2] - steps[0][2])
    ends.append((steps[0][2], steps[-1][2]))
    for w, k, t in run:
        waves_of.setdefault(w, {})[k] = t
ends.sort()
gaps = [b[0] - a[1] for a, b in zip(ends, ends[1:])]
spans["run (first step to last)"] = whole
spans["gap (a run's end to the next's start)"] = gaps
show(f"prefill: {len(runs)} runs", spans)
dspans = collections.defaultdict(list)
for wave, steps in decode.items():
    steps.sort(key=lambda x: x[1])
    for (k0, t0), (k1, t1) in zip(steps, steps[1:]):
        dspans[f"{k0}->{k1}"].append(t1 - t0)
    pre = waves_of.get(int(wave)) if wave.isdigit() else None
    if pre and "post" in pre and steps:
        dspans["prefill post->decode " + steps[0][0]].append(steps[0][1] - pre["post"])
        if "ack" in pre:
            last = dict(steps).get("credit")
            if last is not None:
                dspans["decode credit->prefill ack"].append(pre["ack"] - last)
show(f"decodes: {len(decode)} waves", dspans)
