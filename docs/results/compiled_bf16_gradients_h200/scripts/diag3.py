"""torch._grouped_mm in the layouts the compiled MoE backward calls it with (kernels/ the generated
code): values against per-expert matmuls; run under compute-sanitizer memcheck with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 to catch writes outside each output. `model` as argv[1]: instead
the compiled two-block LLM, two passes."""
import sys
import torch

def loop_mm(a, b, offs, k_grouped):
    starts = [0] + offs.tolist()[:-1]
    if k_grouped:  # a (M, N) b (N, F) grouped over N -> (E, M, F)
        return torch.stack([a[:, s:e].float() @ b[s:e].float() for s, e in zip(starts, offs.tolist())])
    return torch.cat([a[s:e].float() @ b[i].float() for i, (s, e) in enumerate(zip(starts, offs.tolist()))])

def grouped(offs_list):
    torch.manual_seed(0)
    N, D, F, E = 4096, 256, 128, 4
    offs = torch.tensor(offs_list, dtype=torch.int32, device="cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(N, D, **bf); w1 = torch.randn(E, D, F, **bf); w2 = torch.randn(E, F, D, **bf)
    h = torch.randn(N, F, **bf); g = torch.randn(N, D, **bf); g_h = torch.randn(N, F, **bf)
    cases = {
        "fwd x@w1": (x, w1, False),
        "fwd h@w2": (h, w2, False),
        "dw2 hT@g": (h.t(), g, True),          # permute_24 (128, 4096) strides (1, 128)
        "dh g@w2T": (g, w2.transpose(1, 2), False),
        "dw1 xT@gh": (x.t(), g_h, True),       # permute_26 (256, 4096) strides (1, 256)
        "dx gh@w1T": (g_h, w1.transpose(1, 2), False),
    }
    for name, (a, b, k) in cases.items():
        out = torch._grouped_mm(a, b, offs)
        torch.cuda.synchronize()
        ref = loop_mm(a, b, offs, k)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"offs {offs_list} {name:10s} out {tuple(out.shape)} {out.stride()} rel err {err:.1e}", flush=True)

def model():
    sys.path.insert(0, "bench")
    import compiled_gradients as cg
    torch.backends.cuda.matmul.allow_tf32 = False
    base, inputs = cg.build("cuda", cg.SIZES["gpu"])
    for block in base.layers:
        block.compile(backend="inductor")
    cg.gradients(base, inputs, bf16=True, passes=2)
    torch.cuda.synchronize()
    print("model: two compiled passes done", flush=True)

if __name__ == "__main__":
    if sys.argv[1:] == ["model"]:
        model()
    else:
        for offs in ([1100, 2000, 3100, 4096], [1024, 2048, 3072, 4096], [0, 2000, 2000, 4096], [1000, 1001, 3000, 4096]):
            grouped(offs)
