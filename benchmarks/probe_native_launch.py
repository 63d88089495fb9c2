"""The parts of a GemmAllToAll call's host time once its kernel launches natively
(rocmoe/native_launch.py), on a GPU, 4096^3 bf16: the whole call, the native launch,
its argument steps alone, the bare cuLaunchKernel, the stream lookup, the two torch.empty
of the call's outputs, and torch.matmul / torch.mm(out=) for scale. Each figure is the host
time per call over 300 calls queued behind a long GPU sleep. Prints one dict.

    python3 benchmarks/probe_native_launch.py
"""
import time, torch, rocmoe
from rocmoe import ops
from rocmoe.ops import gpu
def us(fn, n=300):
    torch.cuda.synchronize(); torch.cuda._sleep(400_000_000)
    t=time.perf_counter()
    for _ in range(n): fn()
    r=(time.perf_counter()-t)*1e6/n; torch.cuda.synchronize(); return round(r,2)
ctx = rocmoe.init(heap_size=1<<30); dev=ctx.device
m=k=n=4096
x=torch.randn(m,k,device=dev).bfloat16(); w=torch.randn(k,n,device=dev).bfloat16()
h=ops.GemmAllToAll(ctx,m,k,n,torch.bfloat16)
with torch.no_grad():
    for _ in range(4): h(x,w,[m])
    torch.cuda.synchronize()
    plan=next(iter(h._launches.values())); nat=plan.native[True]
    team=gpu.team_for(ctx); out=torch.empty((m,n),dtype=x.dtype,device=dev); recv=torch.empty(1,dtype=torch.int64,device=dev)
    counts=torch.tensor([m],device=dev)
    raw=(x,w,out,counts,team.order,team.peer_bases,recv,*plan.tail_args,m,n,k,plan.per,plan.capacity,plan.nprog,x.stride(0),x.stride(1),0,w.stride(0),w.stride(1),plan.wait_budget)
    d=nat._drv
    r={}
    r["call"]=us(lambda: h(x,w,[m]))
    r["native_launch"]=us(lambda: nat.launch((plan.nprog,),raw))
    r["steps_only"]=us(lambda: [s(raw[p]) for p,s in nat._steps])
    r["driver_call"]=us(lambda: d.launch(nat.function,plan.nprog,1,1,nat.block,1,1,nat.shared,nat._stream(),nat._params,None))
    r["stream"]=us(nat._stream)
    r["empty_out"]=us(lambda: torch.empty((m,n),dtype=x.dtype,device=dev))
    r["empty_recv"]=us(lambda: torch.empty(1,dtype=torch.int64,device=dev))
    r["matmul"]=us(lambda: torch.matmul(x,w))
    r["mm_out"]=us(lambda: torch.mm(x,w,out=out))
print(r)
ctx.finalize()
