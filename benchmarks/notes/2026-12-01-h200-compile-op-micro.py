"""Scratch: host cost of the custom-op layers vs the Python body, on the H200."""
import time, inspect
import torch
import flce_policy.custom_op as C
from torch._library import custom_ops
src = inspect.getsource(custom_ops)
i = src.find("def backend_impl"); print(src[i-200:i+2600])
BT,H,V = 4096,1024,32768
x=torch.randn(BT,H,device="cuda",dtype=torch.bfloat16); w=torch.randn(V,H,device="cuda",dtype=torch.bfloat16)/32
y=torch.randint(0,V,(BT,),device="cuda")
args=(x,w,None,y,None,0,0,0,"","mean",-100,0.0,None,0.0,False,False,False,None,None,True,True,False)
op=torch.ops.flce_policy.fused_linear_cross_entropy.default
def tm(name, fn, n=100):
    for _ in range(5): fn()
    tot=0.0
    for _ in range(n):
        torch.cuda.synchronize(); t=time.perf_counter(); fn(); tot+=time.perf_counter()-t
    torch.cuda.synchronize(); print(f"{name:45s} {tot/n*1e3:.3f} ms host")
with torch.no_grad():
    tm("loss body direct", lambda: C._loss_op._init_fn(*args))
    tm("loss via torch.ops", lambda: op(*args))
    g=torch.zeros(V,H,device="cuda",dtype=torch.bfloat16); one=torch.ones((),device="cuda")
    tm("scale direct", lambda: C.scale_unless_one_(g, one))
    tm("scale via torch.ops", lambda: torch.ops.flce_policy.scale_unless_one_.default([g], one))
    import cProfile, pstats, io
    pr=cProfile.Profile(); pr.enable()
    for _ in range(50):
        torch.cuda.synchronize(); op(*args)
    pr.disable(); s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue())
