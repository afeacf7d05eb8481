"""A probe: does an op on the legacy default stream wait behind a busy torch side stream? (torch's side
streams are blocking streams, ordered with the legacy default stream; kvplan's transport streams are made
non-blocking for that reason: kvplan/transport/streams.py.) ``python -m benchmarks.probes.stream_check`` on a GPU.

Answer (an H200): yes, an op on the legacy default stream waits behind a busy blocking side stream; kvplan's transport streams are non-blocking for that reason.
"""

import time

import torch

s = torch.cuda.Stream()
print("default stream handle", torch.cuda.current_stream().cuda_stream, "side", s.cuda_stream)
a = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
with torch.cuda.stream(s):
    for _ in range(40):
        a @ a
t0 = time.perf_counter()
x = torch.ones(1, device="cuda") + 1
e = torch.cuda.Event()
e.record()
e.synchronize()
print("a default-stream op behind a busy side stream waited %.1f ms" % ((time.perf_counter() - t0) * 1e3))
t1 = time.perf_counter()
torch.cuda.synchronize()
print("the side stream ran %.1f ms more" % ((time.perf_counter() - t1) * 1e3))
