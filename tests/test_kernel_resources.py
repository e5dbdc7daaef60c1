"""Every Triton kernel of a preset's prefill and decode step fits an H100 / H200's shared memory, checked on
the CPU: `benchmarks/kernel_resources.py` lowers the model for an abstract H200 and the `triton` package (a
test dependency on Linux x86-64) compiles each kernel for sm_90. A tile past the limit fails on the GPU only,
at its first call, and only for the widths and dtypes that pick it: float32 models hit two such tiles (the MoE
prefill tiles and the KDA state pass) that no CPU test saw."""

import jax.numpy as jnp
import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize(
    "preset,dtype,quant,batches",
    [
        # KDA, indexer, sparse MLA, MoE with 4-byte operands; then the wider decode tiles of a larger batch (one
        # test: the prefill does not depend on the decode batch, so its kernels are compiled once)
        pytest.param(
            "hybrid_small", "float32", "none", (16, 64), marks=pytest.mark.slow, id="hybrid_small-float32-none-16-64"
        ),
        # 128 heads on FP8 latent rows, float32 queries
        pytest.param(
            "deepseek_v32",
            "float32",
            "hierarchical",
            (16,),
            marks=pytest.mark.slow,
            id="deepseek_v32-float32-hierarchical-16",
        ),
        # dense MLA attention, the pipelined KDA state pass
        pytest.param("kimi_linear_48b", "bfloat16", "none", (16,), id="kimi_linear_48b-bfloat16-none-16"),
    ],
)
def test_preset_kernels_fit_the_shared_memory(preset, dtype, quant, batches, tmp_path):
    from benchmarks.kernel_resources import SMEM_LIMIT, compile_for_hopper, preset_kernels

    compiled = {}  # (Triton IR, warps, stages) -> its resources: a kernel both batches launch is compiled once
    for batch in batches:
        found = preset_kernels(preset, jnp.dtype(dtype), quant, tokens=4096, batch=batch, layers=2)
        sizes = []
        for stage, ks in found.items():
            for k in ks:
                key = (k["ttir"], k["num_warps"], k["num_stages"])
                if key not in compiled:
                    compiled[key] = compile_for_hopper(k, tmp_path)
                sizes.append((stage, k["name"], compiled[key]))
        assert len(sizes) >= 5 and all(r["regs"] for *_, r in sizes), batch  # the kernels were found and compiled
        over = [
            (stage, name, r["smem"], r["error"])
            for stage, name, r in sizes
            if r["smem"] is None or r["smem"] > SMEM_LIMIT
        ]
        assert not over, f"batch {batch}: kernels past {SMEM_LIMIT} bytes of shared memory (or not compiled): {over}"
