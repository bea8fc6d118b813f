"""Scratch (not committed): where the host time of eager vs compiled loss steps goes on the H200."""
import cProfile, pstats, time, io, sys
import torch
from flce_policy import fused_linear_cross_entropy
BT,H,V = 4096,1024,32768
g=torch.Generator(device="cuda").manual_seed(0)
x=(torch.randn(BT,H,device="cuda",generator=g)/8).to(torch.bfloat16).requires_grad_()
w=(torch.randn(V,H,device="cuda",generator=g)/8).to(torch.bfloat16).requires_grad_()
y=torch.randint(0,V,(BT,),device="cuda",generator=g)
torch._dynamo.mark_static_address(x); torch._dynamo.mark_static_address(w)
def f(x,w,y): return fused_linear_cross_entropy(x,w,y)
forms={"eager":f,"compiled":torch.compile(f,fullgraph=True)}
def step(fn):
    fn(x,w,y).backward(); x.grad=None; w.grad=None
for name,fn in forms.items():
    for _ in range(5): step(fn)
    torch.cuda.synchronize()
    n=50; t=time.perf_counter()
    for _ in range(n): step(fn)
    torch.cuda.synchronize(); print(name,"pipelined ms",(time.perf_counter()-t)/n*1e3)
    # host time per part, synced before each step
    tf=tb=0
    for _ in range(n):
        torch.cuda.synchronize(); t0=time.perf_counter(); l=fn(x,w,y); t1=time.perf_counter(); l.backward(); t2=time.perf_counter()
        tf+=t1-t0; tb+=t2-t1; x.grad=None; w.grad=None
    print(name, f"host fwd {tf/n*1e3:.3f} ms bwd {tb/n*1e3:.3f} ms")
for name,fn in forms.items():
    pr=cProfile.Profile()
    torch.cuda.synchronize(); pr.enable()
    for _ in range(50):
        torch.cuda.synchronize(); step(fn)
    pr.disable()
    for key in ("tottime","cumtime"):
        s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats(key).print_stats(40); print("=====",name,key); print(s.getvalue()[-9000:])
