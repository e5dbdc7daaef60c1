"""Every Triton kernel of a preset's prefill and decode step fits an H100 / H200's shared memory, checked on
the CPU: `benchmarks/kernel_resources.py` lowers the model for an abstract H200 and the `triton` package (a
test dependency on Linux x86-64) compiles each kernel for sm_90. A tile past the limit fails on the GPU only,
at its first call, and only for the widths and dtypes that pick it: float32 models hit two such tiles (the MoE
prefill tiles and the KDA state pass) that no CPU test saw."""

import jax.numpy as jnp
import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize(
    "preset,dtype,quant,batch",
    [
        # KDA, indexer, sparse MLA, MoE with 4-byte operands
        pytest.param("hybrid_small", "float32", "none", 16, marks=pytest.mark.slow),
        # the wider decode tiles of a larger batch
        pytest.param("hybrid_small", "float32", "none", 64, marks=pytest.mark.slow),
        # 128 heads on FP8 latent rows, float32 queries
        pytest.param("deepseek_v32", "float32", "hierarchical", 16, marks=pytest.mark.slow),
        ("kimi_linear_48b", "bfloat16", "none", 16),  # dense MLA attention, the pipelined KDA state pass
    ],
)
def test_preset_kernels_fit_the_shared_memory(preset, dtype, quant, batch, tmp_path):
    from benchmarks.kernel_resources import SMEM_LIMIT, compile_for_hopper, preset_kernels

    found = preset_kernels(preset, jnp.dtype(dtype), quant, tokens=4096, batch=batch, layers=2)
    sizes = [(stage, k["name"], compile_for_hopper(k, tmp_path)) for stage, ks in found.items() for k in ks]
    assert len(sizes) >= 5 and all(r["regs"] for *_, r in sizes)  # the kernels were found and compiled
    over = [
        (stage, name, r["smem"], r["error"]) for stage, name, r in sizes if r["smem"] is None or r["smem"] > SMEM_LIMIT
    ]
    assert not over, f"kernels past {SMEM_LIMIT} bytes of shared memory (or not compiled): {over}"
