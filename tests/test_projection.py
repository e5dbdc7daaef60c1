"""The decode-sized projection GEMV kernel (interpret mode on CPU) against its float32 reference, its tile
rules, the choice `impl="auto"` makes, and the model's projections through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels
from hybrid_jax.layers.common import DTypes, Projection, linear
from pallas_kernels.projection import api, project, project_group
from tests.conftest import examples, rel_err


@settings(max_examples=examples(6), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(1,), (1, 1), (3,), (2, 1), (16,), (1, 1, 5)]),
    kdim=st.sampled_from([16, 48, 96, 192]),
    width=st.sampled_from([16, 80, 160, 256]),
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
    split=st.booleans(),
)
def test_kernel_matches_reference(seed, lead, kdim, width, dtype, split):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (*lead, kdim), jnp.float32)
    w = (jax.random.normal(kw, (kdim, width)) * kdim**-0.5).astype(dtype)
    bn, bk = api.auto_tiles(kdim, width)
    # explicit splits: every divisor of the slab count up to 3 (odd ones included), or the automatic one
    split_k = max(s for s in (1, 2, 3) if (kdim // bk) % s == 0) if split else None
    got = project(x, w, impl="pallas", out_dtype=jnp.float32, split_k=split_k)
    ref = project(x.astype(dtype), w, impl="reference", out_dtype=jnp.float32)  # the kernel casts x to w's dtype
    assert got.shape == (*lead, width)
    assert rel_err(got, ref) < 1e-5


@settings(max_examples=examples(6), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(1,), (1, 1), (3,), (2, 1, 2)]),
    kdim=st.sampled_from([32, 96, 192]),
    widths=st.lists(st.sampled_from([16, 48, 128, 160]), min_size=1, max_size=4),
    inputs=st.sampled_from(["shared", "own", "mixed"]),
)
def test_group_matches_one_by_one(seed, lead, kdim, widths, inputs):
    """One launch for several weights gives each weight's own product, whatever the inputs' sharing."""
    keys = jax.random.split(jax.random.key(seed), 2 * len(widths))
    x0 = jax.random.normal(keys[0], (*lead, kdim), jnp.float32).astype(jnp.bfloat16)
    own = [jax.random.normal(k, (*lead, kdim), jnp.float32).astype(jnp.bfloat16) for k in keys[: len(widths)]]
    xs = {"shared": x0, "own": own, "mixed": [x0 if i % 2 else own[i] for i in range(len(widths))]}[inputs]
    wkeys = keys[len(widths) :]
    scale = kdim**-0.5
    ws = [(jax.random.normal(k, (kdim, n)) * scale).astype(jnp.bfloat16) for k, n in zip(wkeys, widths, strict=True)]
    got = project_group(xs, ws, impl="pallas", out_dtype=jnp.float32)
    per = [xs] * len(ws) if inputs == "shared" else xs
    assert len(got) == len(ws)
    for g, x, w in zip(got, per, ws, strict=True):
        assert g.shape == (*lead, w.shape[1])
        assert rel_err(g, project(x, w, impl="reference", out_dtype=jnp.float32)) < 1e-5
    # the group's tile: the largest power of two <= 128 dividing the widths of 64 or more, where the narrower
    # ones are powers of two below it (one padded tile each); else the largest dividing every width
    wide = [n for n in widths if n >= 64]
    tile = max((t for t in (16, 32, 64, 128) if wide and all(n % t == 0 for n in wide)), default=None)
    if tile is None or not all(n % tile == 0 or (n < tile and tile % n == 0 and n in (16, 32)) for n in widths):
        tile = max(t for t in (16, 32, 64, 128) if all(n % t == 0 for n in widths))
    assert api.group_tiles(kdim, widths)[0] == tile


def test_narrow_weight_rides_in_a_padded_tile():
    """A per-head weight (32 columns) grouped with wide ones keeps their 128-column tile: it fills the start
    of one tile of its own; values, lazy partial-sum positions and the launch count are those expected."""
    ks = jax.random.split(jax.random.key(9), 4)
    x = jax.random.normal(ks[0], (1, 1, 256), jnp.float32).astype(jnp.bfloat16)
    widths = (256, 32, 128)
    ws = [(jax.random.normal(k, (256, n)) * 0.06).astype(jnp.bfloat16) for k, n in zip(ks[1:], widths, strict=True)]
    assert api.group_tiles(256, [256, 32, 128]) == (128, 64)
    got = project_group(x, ws, impl="pallas", out_dtype=jnp.float32)
    for g, w in zip(got, ws, strict=True):
        assert g.shape == (1, 1, w.shape[1])
        assert rel_err(g, project(x, w, impl="reference", out_dtype=jnp.float32)) < 1e-5
    lazy = project_group(x, ws, impl="pallas", lazy=True)
    assert [s.start for s in lazy] == [0, 256, 384] and lazy[0].parts.shape[-1] == 512  # 32 padded to a tile
    jaxpr = str(jax.make_jaxpr(lambda x: project_group(x, ws, impl="pallas"))(x))
    assert jaxpr.count("name=projection_gemv") == 1


@settings(max_examples=examples(6), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(1,), (1, 1)]),
    widths=st.sampled_from([(64, 96, 32), (128, 64, 64), (32, 32, 160)]),
    split=st.sampled_from([None, 1, 2]),
)
def test_lazy_partials_feed_the_next_projection(seed, lead, widths, split):
    """lazy=True leaves one-row outputs as split-K partial sums (`SplitK`) whose value is the product; a second
    group reads them without a reduction in between (or their value where they do not line up with its
    slabs) and gets the same numbers as the chain of reference products with the bf16 rounding between."""
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (*lead, 128), jnp.float32).astype(jnp.bfloat16)
    w1 = [(jax.random.normal(k, (128, n)) * 0.09).astype(jnp.bfloat16) for k, n in zip(keys[1:4], widths, strict=True)]
    firsts = project_group(x, w1, impl="pallas", lazy=True, split_k=split)
    assert all(isinstance(f, api.SplitK) for f in firsts)
    values = [project(x, w, impl="reference") for w in w1]  # bf16, as the group's non-lazy outputs
    for f, v in zip(firsts, values, strict=True):
        assert f.shape == v.shape and f.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(f.value(), np.float32), np.asarray(v, np.float32), rtol=1e-2, atol=1e-2)
    # second projections of two of the first outputs, of different K each time: same-K pairs in one group
    k2 = widths[1]
    w2 = [(jax.random.normal(k, (k2, 48)) * k2**-0.5).astype(jnp.bfloat16) for k in jax.random.split(keys[4], 2)]
    xs2 = [firsts[1], firsts[2]] if widths[2] == k2 else [firsts[1], firsts[1]]
    got = project_group(xs2, w2, impl="pallas", out_dtype=jnp.float32)
    for g, x2, w in zip(got, xs2, w2, strict=True):
        ref = project(x2.value(), w, impl="reference", out_dtype=jnp.float32)
        assert g.shape == (*lead, 48) and rel_err(g, ref) < 1e-5
    # non-lazy and reference paths give arrays; a SplitK input also works through the reference
    assert not isinstance(project_group(x, w1, impl="pallas")[0], api.SplitK)
    ref_path = project_group(firsts[1], w2[:1], impl="reference", out_dtype=jnp.float32)[0]
    assert rel_err(ref_path, project(firsts[1].value(), w2[0], impl="reference", out_dtype=jnp.float32)) < 1e-6


def test_group_errors_and_auto(monkeypatch):
    x = jnp.ones((1, 64), jnp.bfloat16)
    w32 = jnp.ones((64, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"weight 1 \(48, 32\) must be \[K, N\] with K = 64"):
        project_group(x, [w32, jnp.ones((48, 32), jnp.bfloat16)])
    with pytest.raises(ValueError, match=r"2 inputs for 3 weights"):
        project_group([x, x], [w32, w32, w32])
    with pytest.raises(ValueError, match=r"input 1 has shape \(2, 64\), input 0 \(1, 64\)"):
        project_group([x, jnp.ones((2, 64), jnp.bfloat16)], [w32, w32])
    with pytest.raises(ValueError, match=r"dtypes differ: \['bfloat16', 'float16'\]"):
        project_group(x, [w32, w32.astype(jnp.float16)])
    with pytest.raises(ValueError, match=r"unknown impl='xla'; expected one of"):
        project_group(x, [w32], impl="xla")
    # a numpy input is one input for every weight, not a sequence of rows
    two = project_group(np.ones((2, 64), np.float32), [w32, w32], impl="reference")
    assert [y.shape for y in two] == [(2, 32), (2, 32)]
    with pytest.raises(ValueError, match=r"share no power-of-two tiles"):
        project_group(x, [w32, jnp.ones((64, 40), jnp.bfloat16)], impl="pallas")
    # auto: the reference on CPU; on a GPU one launch when every weight would take the kernel alone
    shared = jax.random.normal(jax.random.key(0), (1, 256), jnp.float32).astype(jnp.bfloat16)
    ws = [(jax.random.normal(jax.random.key(i), (256, n)) * 0.1).astype(jnp.bfloat16) for i, n in ((1, 32), (2, 48))]
    assert "projection_gemv" not in str(jax.make_jaxpr(lambda x: project_group(x, ws))(shared))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jaxpr = str(jax.make_jaxpr(lambda x: project_group(x, ws, interpret=True))(shared))
    assert jaxpr.count("pallas_call[") == 1 and "name=projection_gemv" in jaxpr
    two_rows = jnp.concatenate([shared, shared])
    with pallas_kernels.use_pallas(ops=["projection"]):  # 2 rows: the kernel only where forced
        forced = str(jax.make_jaxpr(lambda x: project_group(x, ws, interpret=True))(two_rows))
    assert forced.count("pallas_call[") == 1
    assert "projection_gemv" not in str(jax.make_jaxpr(lambda x: project_group(x, ws))(two_rows))


def test_tiles_and_splits():
    assert api.auto_tiles(2304, 4096) == (128, 64)
    assert api.auto_tiles(48, 80) == (16, 16)
    assert api.auto_tiles(40, 64) is None  # K has no 16-multiple tile
    # Kimi q/k/v: 32 output tiles x 36 slabs -> the smallest divisor of 36 giving >= 264 programs is 9
    assert api.auto_split_k(2304, 4096, 128, 64) == 9
    # the lm_head already has 1280 tiles: no split
    assert api.auto_split_k(2304, 163840, 128, 64) == 1
    # too few slabs to reach the target: the largest divisor within MAX_SPLIT_K
    assert api.auto_split_k(64, 128, 128, 16) == 4


def test_errors_name_the_values():
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"unknown impl='triton'; expected one of"):
        project(x, jnp.ones((64, 32), jnp.bfloat16), impl="triton")
    with pytest.raises(ValueError, match=r"agree on K; got x \(2, 64\), w \(48, 32\)"):
        project(x, jnp.ones((48, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"at most 16 rows, got 17"):
        project(jnp.ones((17, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match=r"w \(40, 32\) has no power-of-two tiles"):
        project(jnp.ones((1, 40), jnp.bfloat16), jnp.ones((40, 32), jnp.bfloat16), impl="pallas")
    for rows, seen in ((1, 1), (2, 16)):  # one row, and rows padded to 16
        with pytest.raises(ValueError, match=rf"{seen} row\(s\) of K = 64, .*split_k \* block_k = 5 \* 64"):
            project(jnp.ones((rows, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16), impl="pallas", split_k=5)


def test_auto_rules(monkeypatch):
    x1, x17 = jnp.ones((1, 1, 256), jnp.bfloat16), jnp.ones((17, 256), jnp.bfloat16)
    w = jnp.ones((256, 256), jnp.bfloat16)  # 2 output tiles x 4 slabs: split 4
    assert not api.auto_uses_kernel(x1, w)  # CPU: the reference unless use_pallas() says otherwise
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert api.auto_uses_kernel(x1, w)
    assert not api.auto_uses_kernel(jnp.ones((2, 256), jnp.bfloat16), w)  # 2+ rows: XLA's GEMM by default
    assert not api.auto_uses_kernel(x17, w)  # a GEMM: XLA's
    assert not api.auto_uses_kernel(x1, w.astype(jnp.float32))  # 4-byte weights stay with XLA
    assert not api.auto_uses_kernel(x1, jnp.ones((256, 128 * 264), jnp.bfloat16))  # wide enough: no split
    with pallas_kernels.use_pallas(ops=["projection"]):  # forced: wherever the kernels apply
        assert api.auto_uses_kernel(jnp.ones((2, 256), jnp.bfloat16), w)
    mesh = jax.make_mesh((1,), ("tp",))
    with jax.set_mesh(mesh):  # a one-device mesh partitions nothing
        assert api.auto_uses_kernel(x1, w)


def test_auto_leaves_multi_device_meshes_to_xla():
    """Under a mesh of several devices outside shard_map XLA would gather a tensor-parallel weight for the
    custom call; the check runs in a subprocess with 2 fake CPU devices."""
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp\n"
        "jax.config.update('jax_num_cpu_devices', 2)\n"
        "from pallas_kernels.registry import pallas_call_allowed\n"
        "x, w = jnp.ones((1, 64), jnp.bfloat16), jnp.ones((64, 128), jnp.bfloat16)\n"
        "mesh = jax.make_mesh((2,), ('tp',))\n"
        "with jax.set_mesh(mesh):\n"
        "    assert not pallas_call_allowed()\n"
        "    f = jax.shard_map(lambda: jnp.asarray(pallas_call_allowed()), out_specs=jax.P(), check_vma=False)\n"
        "    assert bool(f())\n"
        "assert pallas_call_allowed()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_model_projection_through_kernel_matches_xla():
    """`linear()`'s module gives nnx.Linear's result through the kernel (bf16 rounding apart) for a decode
    row count, and stays on XLA's path for a prefill."""
    dt = DTypes(compute=jnp.bfloat16, param=jnp.bfloat16)
    layer = linear(96, 160, (None, None), dt, nnx.Rngs(0))
    assert isinstance(layer, Projection) and isinstance(layer, nnx.Linear)
    x = jax.random.normal(jax.random.key(1), (2, 1, 96), jnp.bfloat16)
    plain = nnx.Linear.__call__(layer, x)
    with pallas_kernels.use_pallas(ops=["projection"]):
        fused = jax.jit(lambda x: layer(x))(x)
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x))(x))
        long = str(jax.make_jaxpr(lambda x: layer(x))(jnp.ones((2, 9, 96), jnp.bfloat16)))
    assert fused.dtype == plain.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(plain, np.float32), rtol=2e-2, atol=2e-2)
    assert "projection_gemv" in jaxpr and "projection_gemv" not in long


@pytest.mark.slow
def test_decode_step_groups_projections(tiny_cfg, monkeypatch):
    """At a batch-1 decode step the projections of one input run as one launch per group (`project_many`),
    with the values of the projections one by one and of XLA's path."""
    from hybrid_jax import HybridLM
    from hybrid_jax.layers import common
    from pallas_kernels.projection import kernel

    model = HybridLM(tiny_cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(3), (1, 5), 0, tiny_cfg.vocab_size)
    cache = model.init_cache(1, 16)
    _, cache = jax.jit(lambda m, i, c: m.prefill(i, c))(model, ids, cache)
    launches = []
    launch = kernel.gemv_group_partials

    def counted(*a, **kw):
        launches[-1] += 1
        return launch(*a, **kw)

    monkeypatch.setattr(api, "gemv_group_partials", counted)  # the one launch point (project goes through it)

    def step():  # a fresh trace: use_pallas() and the patches are read at trace time; launches counted in it
        launches.append(0)
        return jax.jit(lambda m, i, c: m.decode_step(i, c)[0])(model, ids[:, -1], cache)

    xla = step()
    with pallas_kernels.use_pallas(ops=["projection"]):
        grouped = step()
        one_by_one = lambda xs, ws, lazy=False, **kw: [project(x, w, **kw) for x, w in zip(xs, ws, strict=True)]  # noqa: E731
        monkeypatch.setattr(common, "project_group", one_by_one)
        single = step()
    assert launches[0] == 0 and 0 < launches[1] < launches[2], launches
    assert rel_err(grouped, single) < 1e-5
    assert rel_err(grouped, xla) < 2e-2  # bf16 weights: XLA's dot and the kernel round differently
