import time, torch
s = torch.cuda.Stream()
print("default stream handle", torch.cuda.current_stream().cuda_stream, "side", s.cuda_stream)
a = torch.randn(8192, 8192, device="cuda"); torch.cuda.synchronize()
with torch.cuda.stream(s):
    for _ in range(40):
        a @ a
t0 = time.perf_counter()
x = torch.ones(1, device="cuda") + 1
e = torch.cuda.Event(); e.record(); e.synchronize()
print("a default-stream op behind a busy side stream waited %.1f ms" % ((time.perf_counter() - t0) * 1e3))
t1 = time.perf_counter(); torch.cuda.synchronize(); print("the side stream ran %.1f ms more" % ((time.perf_counter() - t1) * 1e3))
