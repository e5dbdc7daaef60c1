"""The dispatch registry: one table decides what `impl="auto"` runs for every op, and
`python -m pallas_kernels` prints it for a model."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import OPS, registry, use_pallas
from pallas_kernels.registry import assume_device, resolve

GPU = ("gpu", "9.0")


def test_every_op_has_one_row_and_one_vocabulary():
    assert set(OPS) == set(registry.TABLE)
    for name, op in registry.TABLE.items():
        assert op.name == name
        assert set(op.kernels) <= set(registry.IMPLS) - {"reference"}, name
    with pytest.raises(ValueError, match=r"impl='hopper'"):
        resolve("sparse_mla", "hopper")
    with pytest.raises(ValueError, match=r"impl='mosaic'"):
        resolve("moe", "mosaic", pairs=8, experts=8)
    with pytest.raises(ValueError, match="unknown op 'kda'"):
        resolve("kda")


def test_auto_rule_order():
    """CPU: the reference; a GPU: the default kernels, never the opt-in ones; use_pallas forces either way,
    a shape the kernel does not take stays on the reference with the reason."""
    assert resolve("kda_decode").impl == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with assume_device("cpu"):
        assert resolve("kda_decode").impl == "reference"
        assert "on cpu" in resolve("kda_decode").reason
        with use_pallas():
            assert resolve("kda_decode").impl == "pallas"
            assert resolve("rms_norm", rows=2, slab_ok=True).impl == "pallas"  # opt-in, asked for
            no = resolve("rms_norm", rows=17, slab_ok=True)
            assert no.impl == "reference" and "17 rows > 16" in no.reason
    with assume_device(*GPU):
        assert resolve("kda_decode").impl == "pallas"
        assert resolve("rms_norm", rows=2, slab_ok=True).impl == "reference"  # opt-in only
        assert resolve("kda_summary").impl == "reference"
        assert resolve("indexer_prolog", rows=1, widths_ok=True).impl == "reference"
        with use_pallas(False):
            assert resolve("kda_decode").reason == "use_pallas(False)"
        with use_pallas(ops=["rms_norm"]):
            assert resolve("rms_norm", rows=2, slab_ok=True).impl == "pallas"
            assert resolve("kda_summary").impl == "reference"  # not covered by the block: its default
        assert resolve("kda_decode", "reference").impl == "reference"  # explicit impl as asked


def test_pick_rules_read_the_tuning_tables():
    from pallas_kernels.indexer import tuning as it
    from pallas_kernels.moe import tuning as mt

    with assume_device(*GPU):
        moe = lambda pairs, experts: resolve("moe", pairs=pairs, experts=experts)  # noqa: E731
        assert (moe(mt.GEMV_MAX_PAIRS, 8).impl, moe(mt.GEMV_MAX_PAIRS, 8).form) == ("pallas", "gemv")
        assert moe(mt.GEMV_MAX_PAIRS + 1, mt.DENSE_MAX_EXPERTS + 1).form == "grouped"
        assert moe(mt.GROUPED_MIN_PAIRS, 8).form == "grouped"
        small = moe(mt.GROUPED_MIN_PAIRS - 1, 8)
        assert (small.impl, small.form) == ("reference", "ragged_dot")
        with use_pallas(ops=["moe"]):
            assert moe(2, 8).form == "grouped"

        def select(rows, keys, topk=64):
            return resolve("indexer", head_dim=64, rows=rows, keys=keys, topk=topk).form

        assert select(it.SELECT_KERNEL_MIN_ROWS, 4096) == "kernel"
        assert select(1, it.NEAR_FULL_KEYS_PER_K * 64) == "kernel"
        assert select(1, it.SPLIT_MIN_KEYS_PER_K * 64) == "split"
        assert select(1, it.SPLIT_MIN_KEYS_PER_K * 64 - 1) == "top_k"
        assert resolve("indexer", head_dim=48, rows=1, keys=10, topk=4).impl == "reference"

        def proj(rows, split_k, tiles=(64, 64)):
            return resolve("projection", rows=rows, itemsize=2, tiles=tiles, split_k=split_k).impl

        assert proj(1, 4) == "pallas" and proj(1, 1) == "reference" and proj(2, 4) == "reference"
        assert proj(1, 4, tiles=None) == "reference"
        kda = resolve("kda_prefill", tokens=1)
        assert (kda.impl, kda.form) == ("reference", "recurrent")
        assert resolve("kda_prefill", tokens=65).impl == "pallas"
        assert resolve("attention", head_dim=576, v_head_dim=512).impl == "reference"
        assert resolve("attention", head_dim=192, v_head_dim=128).impl == "pallas"


def test_record_collects_auto_decisions_of_traced_code():
    from pallas_kernels.linear_attention import kda

    x = jnp.ones((1, 5, 2, 16), jnp.float32)
    beta = jnp.ones((1, 5, 2), jnp.float32)
    with assume_device(*GPU), registry.record() as records:
        jax.eval_shape(lambda: kda(x, x, x, -x, beta))
        jax.eval_shape(lambda: kda(x, x, x, -x, beta, impl="reference"))  # explicit: not a decision
    assert [(op, c.impl) for op, c, _ in records] == [("kda_prefill", "pallas")]
    assert records[0][2] == {"tokens": 5, "mosaic_why_not": "bfloat16 inputs (got float32)"}  # the facts the rule read


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pallas_kernels", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_prints_the_dispatch_table_of_a_preset():
    out = _cli("--preset", "tiny", "--backend", "gpu", "--batch", "2", "--tokens", "70")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "sm_90 GPU (assumed)" in lines[0]
    assert any("sparse_mla" in r and "rope 8" in r for r in lines)  # the reason a kernel is not used
    table = "\n".join(lines[1:])
    for phase, function, runs in [
        ("prefill B=2 T=70", "linear_attention.kda ", "mosaic"),  # the Mosaic GPU state pass (bf16)
        ("prefill B=2 T=70", "indexer.indexer_topk", "pallas (split)"),
        ("prefill B=2 T=70", "sparse_attention.sparse_mla", "reference"),  # rope 8: below the kernel's 16
        ("prefill B=2 T=70", "moe.moe_experts", "pallas (grouped)"),
        ("decode B=2 after 70", "moe.moe_experts", "pallas (gemv)"),
        ("decode B=2 after 70", "linear_attention.kda_decode_layer", "pallas"),
        ("decode B=2 after 70", "norm.rms_norm", "reference"),
    ]:
        assert any(phase in r and function in r and runs in r for r in lines), (phase, function, table)
    here = _cli("--preset", "tiny", "--tokens", "8", "--backend", "cpu")
    assert here.returncode == 0 and "pallas" not in here.stdout.split("\n", 1)[1].replace("use_pallas", "")
    bad = _cli("--batch", "0")
    assert bad.returncode == 2 and "--batch 0" in bad.stderr and "Traceback" not in bad.stderr
