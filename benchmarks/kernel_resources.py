"""Shared memory, registers and spills of every Triton kernel a preset's prefill and decode step launch on a
Hopper GPU, compiled on the host: no GPU needed.

A Pallas kernel's tiles only meet the hardware when Triton compiles it, which happens on the GPU, at the first
call: a tile past the 232,448 bytes of shared memory a block may have on an H100 / H200 fails there
(RESOURCE_EXHAUSTED), and only for the widths and dtypes that pick it. Found that way on the H200: the FP8-row
sparse MLA tile with float32 queries (acb2fd9) and the MoE prefill tiles with float32 operands (96843e1). Here
the model is lowered for an abstract H200 with the GPU defaults (`impl="auto"` as on a GPU: an abstract model
and cache, nothing allocated), the Triton IR of each kernel is taken as Pallas hands it to XLA, run through
Triton's TTIR passes (as a compiler handed that IR does; from 2026-12-01 15:00, see `_with_ttir_passes`), and the
`triton` package compiles it for sm_90 with the kernel's warps and stages (in the `test` extra on Linux
x86-64, else `pip install triton`; its bundled `ptxas -v` gives registers and spills). XLA compiles the same
IR with its own copy of Triton, which may allocate differently. Compared with the H200's error messages: equal
to the byte for two sparse-MLA variants (295,168 and 286,976 bytes), higher for two kernels (294,912 against
262,144 for the MoE prefill tiles in float32, 353,536 against 238,848 for the FP8-row sparse MLA tile with
float32 queries) — those comparisons predate the TTIR passes. Read the figures as upper bounds (in the four
cases compared none read lower than the GPU's): over the limit here may still fit there.

    python -m benchmarks.kernel_resources                               # every preset, bf16 and float32
    python -m benchmarks.kernel_resources --presets deepseek_v32 --dtypes float32 --quant none hierarchical
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import report

SMEM_LIMIT = 232_448  # bytes of shared memory one block may opt into on sm_90 (H100 / H200)


def lower_for_h200(fn, *args, axis_types=None):
    """`jax.jit(fn)` traced on `args` and lowered for an abstract NVIDIA H200 (no GPU needed): Pallas's
    Triton lowering runs; Triton's own compilation does not."""
    from jax._src import mesh as mesh_lib  # AbstractDevice is private

    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = mesh_lib.AbstractMesh((1,), ("x",), axis_types=axis_types, abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_kernels(fn, *args) -> list[dict]:
    """The Triton kernels in `fn(*args)` lowered for an abstract H200: [{name, ttir, num_warps, num_stages}],
    one per distinct kernel (the layers of a stack repeat theirs)."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    found, last = {}, {}
    lower_module, custom_call = reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call

    def grab_module(*a, **k):
        result = lower_module(*a, **k)
        last["ttir"] = result.module.operation.get_asm(enable_debug_info=False)
        return result

    def grab_call(*a, backend_config=None, **k):
        if k.get("call_target_name") == "__gpu$xla.gpu.triton" and backend_config:
            ttir = last.pop("ttir")
            warps, stages = (int(str(backend_config[n]).split(":")[0]) for n in ("num_warps", "num_stages"))
            name = str(backend_config["name"]).strip('"')
            key = hashlib.sha1(f"{ttir}{warps}{stages}".encode()).hexdigest()
            found.setdefault(key, dict(name=name, ttir=ttir, num_warps=warps, num_stages=stages))
        return custom_call(*a, backend_config=backend_config, **k)

    reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = grab_module, grab_call
    backend = jax.default_backend
    jax.default_backend = lambda: "gpu"  # the GPU defaults, not interpret mode
    try:
        lower_for_h200(fn, *args, axis_types=(jax.sharding.AxisType.Auto,))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = lower_module, custom_call
        jax.default_backend = backend
    return list(found.values())


def _with_ttir_passes(path: Path, target, options: dict) -> Path:
    """The Triton IR at `path` after Triton's own TTIR passes (inlining, canonicalisation, `combine`, ...),
    written beside it. `triton.compile` starts an IR file past those passes, while a compiler handed the
    IR (XLA) runs them: without them `acc * alpha + dot(p, v)` keeps the product's zero accumulator and a
    second accumulator-sized tensor (combine folds the add into the dot), which overstated registers and
    spills (the 32-head sparse MLA decode tile: 944 bytes of spills without the passes, 152 with them)."""
    from triton._C.libtriton import ir
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(target)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(str(path), context)
    module.context = context  # make_ttir reads it; a parsed module does not carry it
    module = backend.make_ttir(module, {}, backend.parse_options(options), target.arch)
    out = path.with_suffix(".passes.ttir")
    out.write_text(str(module))
    return out


def compile_for_hopper(kernel: dict, workdir: Path) -> dict:
    """{smem, regs, spills} of one kernel compiled by the `triton` package for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    path = workdir / f"{kernel['name']}_{hashlib.sha1(kernel['ttir'].encode()).hexdigest()[:10]}.ttir"
    path.write_text(kernel["ttir"])
    options = dict(num_warps=kernel["num_warps"], num_stages=kernel["num_stages"])
    target = GPUTarget("cuda", 90, 32)
    try:
        path = _with_ttir_passes(path, target, options)
        compiled = triton.compile(str(path), target=target, options=options)
    except Exception as e:  # noqa: BLE001 — e.g. Triton's own out-of-resources check: a result here
        return dict(smem=None, regs=None, spills=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    ptx = path.with_suffix(".ptx")
    ptx.write_text(compiled.asm["ptx"])
    ptxas = get_ptxas(90).path
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    return dict(
        smem=compiled.metadata.shared,
        regs=int(regs.group(1)) if regs else None,
        spills=int(spills.group(1)) if spills else None,
        error="",
    )


def preset_kernels(preset: str, dtype, quant_name: str, tokens: int, batch: int, layers: int) -> dict:
    """{"prefill": kernels, "decode": kernels} of the preset's first `layers` layers (plus one of each type)."""
    from flax import nnx

    from benchmarks.gpu_parity import cut_config
    from hybrid_jax import PRESETS, HybridLM
    from hybrid_jax.quant.config import QuantConfig

    full = PRESETS[preset]()
    cfg = cut_config(full, layers, full.num_experts)  # every expert: MoE paths depend on the count
    quant = QuantConfig.hierarchical() if quant_name == "hierarchical" else None
    param_dtype = None if quant and quant.projection.param_dtype is not None else dtype
    model = nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    page = cfg.page_size

    def prefill(state, ids, cache):
        return nnx.merge(graphdef, state).prefill(ids, cache, last_only=True)

    def decode(state, ids, cache):
        return nnx.merge(graphdef, state).decode_step(ids, cache)

    out = {}
    for stage, b, t, fn in (("prefill", 1, tokens, prefill), ("decode", batch, 1, decode)):
        cache = jax.eval_shape(lambda b=b: model.init_cache(b, -(-(tokens + 1) // page) * page))
        ids = jax.ShapeDtypeStruct((b, t) if stage == "prefill" else (b,), jnp.int32)
        out[stage] = triton_kernels(fn, state, ids, cache)
    return out


def main() -> None:
    from hybrid_jax import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=[n for n in PRESETS if n != "tiny"], choices=list(PRESETS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--quant", nargs="+", default=["none", "hierarchical"], choices=["none", "hierarchical"])
    p.add_argument("--tokens", type=int, default=4096, help="prefill length (past the indexer's top-k)")
    p.add_argument("--batch", type=int, default=16, help="decode batch")
    p.add_argument("--layers", type=int, default=2, help="first layers kept (plus one of each layer type)")
    p.add_argument("--all", action="store_true", help="every kernel, not only those over or near the limit")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    rows, total, over = [], 0, 0
    with tempfile.TemporaryDirectory(prefix="hybrid_jax_triton_") as tmp:
        for preset in args.presets:
            for dtype_name in args.dtypes:
                for quant_name in args.quant:
                    found = preset_kernels(preset, jnp.dtype(dtype_name), quant_name, args.tokens, args.batch,
                                           args.layers)  # fmt: skip
                    for stage, kernels in found.items():
                        for k in kernels:
                            res = compile_for_hopper(k, Path(tmp))
                            total += 1
                            fits = res["smem"] is not None and res["smem"] <= SMEM_LIMIT
                            over += not fits
                            verdict = "fits" if fits else "OVER" if res["smem"] else f"no compile: {res['error']}"
                            row = dict(preset=preset, dtype=dtype_name, quant=quant_name, stage=stage, kernel=k["name"],
                                       warps=k["num_warps"], stages=k["num_stages"], smem=res["smem"],
                                       regs=res["regs"], spills=res["spills"], verdict=verdict)  # fmt: skip
                            print(" | ".join(str(v) for v in row.values()), flush=True)
                            if args.all or not fits or res["smem"] > 0.9 * SMEM_LIMIT:
                                rows.append(row)
    title = (
        f"Triton kernels of each preset's prefill ({args.tokens} tokens) and decode step (batch {args.batch}) "
        f"compiled on the host for sm_90: {total} kernels, {over} over {SMEM_LIMIT:,} bytes of shared memory"
        + ("" if args.all else "; rows: those over or within 10% of the limit")
    )
    rows = rows or [dict(result=f"all {total} kernels under {0.9 * SMEM_LIMIT:,.0f} bytes")]
    report("kernel_resources.py", title, rows, record=not args.no_record)
    if over:
        raise SystemExit(f"kernel_resources: {over} kernel(s) do not fit the shared memory")


if __name__ == "__main__":
    main()
