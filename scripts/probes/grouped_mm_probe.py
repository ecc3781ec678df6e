"""Probe torch._grouped_mm's layout rules on this GPU (what the v1 backend relies on)."""
import torch, traceback
torch.manual_seed(0)
dev = "cuda"
E, H, I = 4, 256, 128
cap = 1024
offs = torch.tensor([128, 384, 384, 768], dtype=torch.int32, device=dev)  # expert 2 empty
a = torch.randn(cap, H, device=dev, dtype=torch.bfloat16)
w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16)   # [N, K] per expert
w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16)

def ref_fwd(a, w, offs):   # a [M,K], w [E,N,K]
    out = torch.zeros(a.shape[0], w.shape[1], device=dev)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].float() @ w[e].float().t(); start = end
    return out

def rel(x, y): return float((x.float() - y.float()).norm() / y.float().norm())
def attempt(name, fn):
    try:
        r = fn(); print(f"{name}: OK", r if not isinstance(r, torch.Tensor) else tuple(r.shape))
    except Exception as e:
        print(f"{name}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}")

attempt("fwd B=w^T view", lambda: rel(torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)[:768], ref_fwd(a, w1, offs)[:768]))
attempt("fwd B row-major [E,K,N]", lambda: rel(torch._grouped_mm(a[:, :I].contiguous(), w2.transpose(1,2).contiguous(), offs=offs)[:768], ref_fwd(a[:, :I], w2, offs)[:768]))
attempt("dgrad B = w2 as is [E,H,I] (K=H,N=I)", lambda: rel(torch._grouped_mm(a, w2, offs=offs)[:768], ref_fwd(a, w2.transpose(1,2), offs)[:768]))
attempt("out_dtype fp32", lambda: torch._grouped_mm(a, w1.transpose(1, 2), offs=offs, out_dtype=torch.float32).dtype)
g = torch.randn(cap, H, device=dev, dtype=torch.bfloat16); act = torch.randn(cap, I, device=dev, dtype=torch.bfloat16)
def ref_wgrad(g, act, offs):
    outs = []; start = 0
    for end in offs.tolist():
        outs.append(g[start:end].float().t() @ act[start:end].float()); start = end
    return torch.stack(outs)
attempt("wgrad A=g.t() view, B=act", lambda: rel(torch._grouped_mm(g.t(), act, offs=offs), ref_wgrad(g, act, offs)))
attempt("wgrad A=g.t().contiguous(), B=act", lambda: rel(torch._grouped_mm(g.t().contiguous(), act, offs=offs), ref_wgrad(g, act, offs)))
attempt("wgrad A=g.t() view, B=act.t().contiguous().t()", lambda: rel(torch._grouped_mm(g.t(), act.t().contiguous().t(), offs=offs), ref_wgrad(g, act, offs)))
attempt("wgrad empty group is zero", lambda: float(torch._grouped_mm(g.t(), act, offs=offs)[2].abs().max()))
r1 = torch._grouped_mm(a, w1.transpose(1, 2), offs=offs); r2 = torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)
print("fwd deterministic:", torch.equal(r1[:768], r2[:768]))
w1g = [torch._grouped_mm(g.t(), act, offs=offs) for _ in range(2)]
print("wgrad deterministic:", torch.equal(*w1g))
# sync-free?
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
attempt("no sync fwd", lambda: torch._grouped_mm(a, w1.transpose(1, 2), offs=offs).shape)
attempt("no sync wgrad", lambda: torch._grouped_mm(g.t(), act, offs=offs).shape)
torch.cuda.set_sync_debug_mode(0)
# pinned memory visible from device by its host pointer (UVA)?
p = torch.zeros(4, dtype=torch.int64, pin_memory=True)
print("pinned is_pinned", p.is_pinned(), "data_ptr", hex(p.data_ptr()))
# timing of fwd at a real shape
import time
E2, H2, I2, rows = 32, 7168, 2048, 8192 * 8
a2 = torch.randn(rows, H2, device=dev, dtype=torch.bfloat16); w = torch.randn(E2, 2 * I2, H2, device=dev, dtype=torch.bfloat16) * 0.02
offs2 = torch.arange(1, E2 + 1, device=dev, dtype=torch.int32) * (rows // E2)
for _ in range(3): torch._grouped_mm(a2, w.transpose(1, 2), offs=offs2)
torch.cuda.synchronize(); t = time.time()
for _ in range(10): torch._grouped_mm(a2, w.transpose(1, 2), offs=offs2)
torch.cuda.synchronize(); dt = (time.time() - t) / 10
print(f"grouped_mm fc1 deepseek-v3 ep8 proxy T=8192: {dt*1e3:.2f} ms, {2*rows*H2*2*I2/dt/1e12:.0f} TFLOP/s")
