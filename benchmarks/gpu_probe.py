"""Which forms of the GPU's FP8 GEMM (``torch._scaled_mm``) this torch/cuBLAS accepts, and whether the
grouped expert GEMM (``torch._grouped_mm``, bf16) equals a loop of plain GEMMs. One line per variant.

    python benchmarks/gpu_probe.py
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operands(m, k, n, a_dtype=E4M3, b_dtype=E4M3):
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=gen).to(a_dtype)
    b = torch.randn(n, k, device="cuda", generator=gen).to(b_dtype).t()  # column-major [k, n]
    return a, b


def try_variant(name, fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        print(f"ok      {name}: {tuple(out.shape)} {out.dtype}", flush=True)
        return out
    except Exception as err:  # noqa: BLE001 - the probe reports every failure
        print(f"FAILED  {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
        return None


def scaled_mm_variants() -> None:
    one = torch.ones((), device="cuda")
    for m, k, n in ((64, 32, 32), (8192, 2048, 6144)):
        a, b = operands(m, k, n)
        ref = (a.float() @ b.float())
        for shape in ((), (1,), (1, 1)):
            for out_dtype in (torch.bfloat16, torch.float32):
                out = try_variant(f"{m}x{k}x{n} e4m3 scales {shape} out {out_dtype}", torch._scaled_mm, a, b,
                                  scale_a=one.reshape(shape), scale_b=one.reshape(shape), out_dtype=out_dtype)
                if out is not None:
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    print(f"        max error / max |ref|: {err:.2e}")
        try_variant(f"{m}x{k}x{n} e4m3 fast accum", torch._scaled_mm, a, b, scale_a=one, scale_b=one,
                    out_dtype=torch.bfloat16, use_fast_accum=True)
        a2, b2 = operands(m, k, n, E5M2, E4M3)
        try_variant(f"{m}x{k}x{n} e5m2 x e4m3", torch._scaled_mm, a2, b2, scale_a=one, scale_b=one,
                    out_dtype=torch.bfloat16)
        rows, cols = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        try_variant(f"{m}x{k}x{n} row-wise scales", torch._scaled_mm, a, b, scale_a=rows, scale_b=cols,
                    out_dtype=torch.bfloat16)
    print("torch.nn.functional.scaled_mm:", hasattr(torch.nn.functional, "scaled_mm"))


def grouped_mm_check() -> None:
    if not hasattr(torch, "_grouped_mm"):
        print("torch._grouped_mm: absent")
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, k, n, counts = 4, 64, 128, [16, 0, 48, 64]
    x = torch.randn(sum(counts), k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(experts, k, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = try_variant("grouped_mm bf16", torch._grouped_mm, x, w, offs=offs)
    if out is None:
        return
    loop = torch.cat([xi.float() @ w[i].float() for i, xi in enumerate(x.split(counts))])
    print(f"        grouped vs fp32 loop: max error / max |ref| {((out.float() - loop).abs().max() / loop.abs().max()).item():.2e}")


if __name__ == "__main__":
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
          "cublasLt", getattr(torch._C, "_cuda_getCompiledVersion", lambda: "?")())
    scaled_mm_variants()
    grouped_mm_check()
    from megatron_lite.parallel.grad_accumulation import fp32_output_gemm

    for dtype in (torch.bfloat16, torch.float16):  # gradient-accumulation fusion's fp32-output GEMM
        print(f"addmm out_dtype=float32 with {dtype} inputs:", fp32_output_gemm(torch.device("cuda", 0), dtype))
