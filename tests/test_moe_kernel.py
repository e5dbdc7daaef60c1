"""The Pallas grouped-matmul MoE experts (interpret mode on CPU) against the ragged_dot reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.moe import api, gemv, moe_experts
from pallas_kernels.moe.gemv import auto_split_k
from tests.conftest import examples, rel_err


def _case(seed, n, d, f, e, k, skew):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, d))
    # skew > 0 crowds the tokens onto few experts (others get none); distinct experts per token
    logits = jax.random.normal(ks[1], (n, e)) - skew * jnp.arange(e)[None, :]
    idx = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (n, k)), axis=-1)
    gate, up = (jax.random.normal(kk, (e, d, f)) * d**-0.5 for kk in ks[3:5])
    down = jax.random.normal(ks[5], (e, f, d)) * f**-0.5
    return x, idx, w, gate, up, down


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 40),
    d=st.sampled_from([16, 48, 64]),
    f=st.sampled_from([16, 40, 32]),
    e=st.sampled_from([4, 9]),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0]),
    block_m=st.sampled_from([16, 32]),
)
def test_moe_kernel_matches_reference(seed, n, d, f, e, k, skew, block_m):
    args = _case(seed, n, d, f, e, k, skew)
    ref = moe_experts(*args, impl="reference")
    got = moe_experts(*args, impl="pallas", block_m=block_m, block_n=16, block_k=16, precision="ieee", interpret=True)
    assert got.shape == ref.shape and np.isfinite(np.asarray(got)).all()
    assert rel_err(got, ref) < 1e-5


def test_moe_kernel_bf16_and_all_tokens_on_one_expert():
    x, idx, w, gate, up, down = _case(3, 33, 64, 32, 6, 2, 0.0)
    idx = jnp.stack([jnp.zeros(33, jnp.int32), jnp.full((33,), 5, jnp.int32)], axis=1)  # experts 1-4 idle
    args = (x.astype(jnp.bfloat16), idx, w, *(a.astype(jnp.bfloat16) for a in (gate, up, down)))
    ref = moe_experts(*args, impl="reference")
    got = moe_experts(*args, impl="pallas", precision="ieee", interpret=True)
    assert rel_err(got, ref) < 1e-2  # both round h to bf16 between the products


def test_moe_experts_rejects_bad_arguments():
    x, idx, w, gate, up, down = _case(0, 4, 16, 32, 4, 2, 0.0)
    with pytest.raises(ValueError, match="unknown impl"):
        moe_experts(x, idx, w, gate, up, down, impl="triton")
    with pytest.raises(ValueError, match="block_m=24"):
        moe_experts(x, idx, w, gate, up, down, impl="pallas", block_m=24)
    with pytest.raises(ValueError, match="down_proj.shape"):
        moe_experts(x, idx, w, gate, up, gate, impl="pallas")


def test_reference_sums_each_tokens_pairs_in_a_fixed_order():
    """The reference against a float64 sum over each token's pairs, and without a scatter-add: a GPU adds a
    scatter's colliding rows in whatever order its atomics land, so bf16 decoding changed run to run."""
    from pallas_kernels.moe.reference import moe_experts_reference

    x, idx, w, gate, up, down = _case(11, 23, 48, 40, 9, 3, 1.0)
    got = moe_experts_reference(x, idx, w, gate, up, down)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    want = np.zeros((23, 48))
    for t in range(23):
        for j in range(3):
            e = int(idx[t, j])
            g, u = f64(x[t]) @ f64(gate[e]), f64(x[t]) @ f64(up[e])
            want[t] += f64(w[t, j]) * ((g / (1 + np.exp(-g)) * u) @ f64(down[e]))
    assert rel_err(got, want) < 1e-5
    jaxpr = str(jax.make_jaxpr(moe_experts_reference)(x, idx, w, gate, up, down))
    assert not re.search(r"(f16|bf16|f32|f64)\[[\d,]*\] = scatter-add", jaxpr)


def test_reference_in_token_blocks_equals_one_pass():
    from pallas_kernels.moe.reference import moe_experts_reference, token_block

    args = _case(5, 37, 48, 40, 9, 3, 1.0)
    whole = moe_experts_reference(*args)
    assert token_block(37, 3, 9, 48, budget=5000) == 3  # 3 tokens x 3 pairs x 9 experts x 48 wide <= 5000
    blocked = moe_experts_reference(*args, budget=5000)  # 13 blocks, the last one padded
    assert rel_err(blocked, whole) < 1e-6
    assert token_block(1, 8, 256, 7168) == 1  # never fewer than one token


def test_auto_picks_kernel_on_gpu_from_pair_threshold(monkeypatch):
    """On a GPU, "auto" runs the grouped kernel for prefill-sized calls (>= GROUPED_MIN_PAIRS token-expert pairs)
    or many experts, the GEMV kernels for one token's pairs; over few experts the expert-grouped GEMV kernels up
    to EXPERT_GEMV_MAX_TOKENS tokens, the grouped kernel up to FEW_TOKENS_GROUPED_MAX, and XLA's ragged_dot for
    other decode-sized calls; on CPU always the reference."""
    from pallas_kernels.moe import api
    from pallas_kernels.moe import tuning as t
    from pallas_kernels.registry import resolve

    def traced(n, e=4, k=2):
        args = _case(0, n, 16, 16, e, k, 0.0)
        return str(jax.make_jaxpr(lambda *a: moe_experts(*a, interpret=True))(*args))

    big = t.GROUPED_MIN_PAIRS // 2  # x k=2 pairs: exactly at the threshold
    assert "pallas_call" not in traced(big)  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "name=moe_grouped_matmul" in traced(big)
    small = traced(big - 1)
    assert "pallas_call" not in small and "ragged_dot" in small
    many = traced(6, e=t.DENSE_MAX_EXPERTS + 1)  # decode (12 pairs), but the dense product would read all experts
    assert "name=moe_grouped_matmul" in many
    for e in (4, t.DENSE_MAX_EXPERTS + 1):  # one token's pairs (<= GEMV_MAX_PAIRS): per-pair GEMV kernels
        one = traced(t.GEMV_MAX_PAIRS // 2, e=e)
        assert "name=moe_gate_up_gemv" in one and "ragged_dot" not in one
    assert "name=moe_gate_up_gemv" not in traced(t.GEMV_MAX_PAIRS // 2 + 1)
    # a few tokens past one token's pairs (a verify block) over few experts: the expert-grouped GEMV kernels, then
    # the grouped kernel; both read only the experts the call touches, where ragged_dot reads them all
    few = traced(t.EXPERT_GEMV_MAX_TOKENS, e=16, k=8)  # k = 8 (Kimi): a 3-token block is 24 pairs
    assert "name=moe_gate_up_expert_gemv" in few and "ragged_dot" not in few
    more = traced(t.EXPERT_GEMV_MAX_TOKENS + 1, e=16, k=8)
    assert "name=moe_gate_up_expert_gemv" not in more and "name=moe_grouped_matmul" in more
    assert "name=moe_grouped_matmul" in traced(t.FEW_TOKENS_GROUPED_MAX, e=16, k=8)
    assert "ragged_dot" in traced(t.FEW_TOKENS_GROUPED_MAX + 1, e=16, k=8)
    assert "name=moe_grouped_matmul" in traced(t.EXPERT_GEMV_MAX_TOKENS, e=t.DENSE_MAX_EXPERTS + 1, k=8)
    # grouped kernel rows: 16-row blocks until experts average 16 rows, and below SMALL_CALL_PAIRS
    assert api.auto_block_m(512, 256) == 16 and api.auto_block_m(16 * 256, 256) == 128
    assert api.auto_block_m(511, 4) == 16 and api.auto_block_m(512, 32) == 128
    grouped = resolve("moe", pairs=256, experts=32)  # hybrid_small, 64 tokens
    assert (grouped.impl, grouped.form) == ("pallas", "grouped") and api.auto_block_m(256, 32) == 16
    from pallas_kernels import use_pallas

    with use_pallas(ops=["moe"]):  # a use_pallas block still gets the kernel
        assert "name=moe_grouped_matmul" in traced(1, e=t.DENSE_MAX_EXPERTS + 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_weights_match_reference(dtype):
    args = _case(5, 3, 48, 40, 9, 3, 3.0)  # skewed: several tokens share experts, others are idle
    args = (args[0].astype(dtype), *args[1:3], *(a.astype(dtype) for a in args[3:]))
    ref = moe_experts(*args, impl="reference")
    got = moe_experts(*args, impl="reference", form="gather")
    assert got.dtype == jnp.float32 and rel_err(got, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 6),
    d=st.sampled_from([16, 40, 72]),  # 40, 72: padded to whole contraction / output tiles
    f=st.sampled_from([16, 24, 48]),
    e=st.sampled_from([4, 9]),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0]),  # 3.0: tokens crowd onto few experts (pairs share weights)
    block=st.sampled_from([(16, 16), (32, 16), (16, 64)]),
    split_k=st.sampled_from([None, 1, 2, 4]),  # None: auto_split_k; 4: contractions padded to 4 whole slabs
)
def test_gemv_kernels_match_reference(seed, n, d, f, e, k, skew, block, split_k):
    args = _case(seed, n, d, f, e, k, skew)
    ref = moe_experts(*args, impl="reference")
    got = moe_experts(
        *args, impl="pallas", form="gemv", block_n=block[0], block_k=block[1], split_k=split_k, interpret=True
    )
    assert got.shape == ref.shape and got.dtype == jnp.float32
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("split_k", [None, 2])
def test_gemv_tensor_core_form_matches_multiply_adds(split_k):
    """bf16 rows take the tensor-core form (the row broadcast to a 16-row tile); it matches the CUDA-core
    form and the reference (both round h to bf16 between the products)."""
    x, idx, w, gate, up, down = _case(11, 3, 72, 48, 9, 3, 3.0)
    args = (x.astype(jnp.bfloat16), idx, w, *(a.astype(jnp.bfloat16) for a in (gate, up, down)))
    ref = moe_experts(*args, impl="reference")
    mma = moe_experts(*args, impl="pallas", form="gemv", block_n=16, block_k=16, split_k=split_k, interpret=True)
    fma = api._experts_gemv(*args, 16, 16, split_k, True, mma=False)
    assert rel_err(mma, fma) < 5e-3 and rel_err(mma, ref) < 1e-2

    def dots(mma):  # dot_generals in the traced call, kernel bodies included
        form = jax.make_jaxpr(lambda *a: api._experts_gemv(*a, 16, 16, split_k, True, mma=mma))(*args)
        return str(form).count("dot_general")

    assert dots(True) == dots(False) + 3  # tensor-core products: gate and up in one kernel, down in the other


def test_gemv_split_k_rule_and_errors():
    # One Kimi token: 8 pairs x 1024 / 32 output tiles = 256 programs -> split 4 ways (1024 programs, the
    # target); a split never leaves a partial contraction slab.
    assert auto_split_k(8, 1024, 2304, 32, 64) == 4
    assert auto_split_k(8, 1024, 2304, 32, 256) == 1  # 2304 / 256 = 9 slabs: odd, no whole halves
    assert auto_split_k(128, 1024, 2304, 32, 64) == 1  # 16 tokens: 4096 programs already
    assert auto_split_k(1, 64, 1 << 20, 64, 16) == gemv.MAX_SPLIT_K
    args = _case(1, 2, 40, 24, 9, 3, 0.0)
    with pytest.raises(ValueError, match="split_k=3"):
        moe_experts(*args, impl="pallas", form="gemv", split_k=3, interpret=True)
    e_ids = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="contraction 48 must be a multiple of split_k"):
        gemv.down_gemv(e_ids, jnp.ones((2, 48)), jnp.ones((9, 48, 32)), block_n=32, block_k=16, split_k=2,
                       interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="3 rows x 2 pairs per row != 2 expert ids"):
        w = jnp.ones((9, 32, 32))
        gemv.gate_up_gemv(e_ids, jnp.ones((3, 32)), w, w, block_n=32, block_k=16, pairs_per_row=2, interpret=True)
    with pytest.raises(ValueError, match="2 rows leave none after the 2 pairs"):
        gemv.down_gemv(e_ids, jnp.ones((2, 32)), w, block_n=32, block_k=16, shared=(w[0],), interpret=True)


@pytest.mark.parametrize("mma", [True, False])
def test_down_gemv_forms_h_from_gate_up_partials(mma):
    """down_gemv given gate_up_gemv's (gate, up) partial sums (3 splits: no power of two) forms each slab of
    h = SiLU(Σ gate) ⊙ Σ up itself, rounded as gate_up_gemv rounds it: the values of the call given h."""
    ks = jax.random.split(jax.random.key(7), 4)
    e_ids = jnp.array([3, 0, 3, 5], jnp.int32)
    dtype = jnp.bfloat16 if mma else jnp.float32
    g, u = (jax.random.normal(k, (4, 3, 96)) for k in ks[:2])
    down = jax.random.normal(ks[2], (6, 96, 64), dtype)
    h = (jax.nn.silu(jnp.sum(g, axis=1)) * jnp.sum(u, axis=1)).astype(dtype)
    kw = dict(block_n=32, block_k=16, split_k=2, mma=mma, interpret=True)
    want = gemv.down_gemv(e_ids, h, down, **kw)
    got = gemv.down_gemv(e_ids, (g, u), down, h_dtype=dtype, **kw)
    assert got.shape == want.shape == (4, 64)
    assert rel_err(got, want) < (1e-2 if mma else 1e-5)  # bf16 h: an element may round the other way
    with pytest.raises(ValueError, match="needs h_dtype"):
        gemv.down_gemv(e_ids, (g, u), down, **kw)


def test_gemv_kernels_bf16():
    args = _case(11, 2, 40, 24, 9, 3, 3.0)
    args = (args[0].astype(jnp.bfloat16), *args[1:3], *(a.astype(jnp.bfloat16) for a in args[3:]))
    ref = moe_experts(*args, impl="reference")
    got = moe_experts(*args, impl="pallas", form="gemv", interpret=True)
    assert rel_err(got, ref) < 1e-2
    jaxpr = str(jax.make_jaxpr(lambda *a: moe_experts(*a, impl="pallas", form="gemv", interpret=True))(*args))
    assert "name=moe_gate_up_gemv" in jaxpr and "name=moe_down_gemv" in jaxpr


def test_gemv_default_tiles_differ_per_kernel_and_a_given_tile_applies_to_both():
    """form="gemv" at widths past both defaults: gate/up takes `GEMV_TILES`, the down kernel `GEMV_DOWN_TILES`
    (its output tiles read from the launch's grid); an explicit block_n / block_k tiles both kernels. Values
    against the reference either way."""
    from pallas_kernels.moe.tuning import GEMV_DOWN_TILES, GEMV_TILES

    n, d, f, e, k = 1, 256, 192, 6, 2
    args = _case(13, n, d, f, e, k, 0.0)
    ref = moe_experts(*args, impl="reference")

    def launches(fn):  # each pallas_call's (grid, name), in launch order: gate/up then down
        text = str(jax.make_jaxpr(fn)(*args))
        return [(m.group(1), m.group(2)) for m in re.finditer(r"grid=\(([0-9, ]+)\).*?name=(moe_\w+_gemv)", text, re.S)]

    def grids(**kw):
        fn = lambda *a: moe_experts(*a, impl="pallas", form="gemv", interpret=True, **kw)  # noqa: E731
        assert rel_err(fn(*args), ref) < 1e-5
        return launches(fn)

    def axes(grid):  # (programs per pair row, output tiles, splits)
        return tuple(int(a) for a in grid.split(",") if a.strip())

    (gu_grid, gu), (dn_grid, dn) = grids()
    assert (gu, dn) == ("moe_gate_up_gemv", "moe_down_gemv")
    # the down kernel's splits follow from its block_k over F (192: whole 64-deep slabs, 128 would pad it)
    down_n, down_k = GEMV_DOWN_TILES
    assert axes(gu_grid)[1] == -(-f // GEMV_TILES[0])  # gate/up's output F in its block_n tiles
    assert axes(dn_grid)[1:] == (d // down_n, auto_split_k(n * k, d, f, down_n, down_k))
    (gu_grid, _), (dn_grid, _) = grids(block_n=32, block_k=32)
    assert axes(gu_grid)[1] == f // 32 and axes(dn_grid)[1:] == (d // 32, auto_split_k(n * k, d, f, 32, 32))
    # a shared expert of another width runs outside the launches: the routed down kernel keeps its own tiles
    shared = tuple(jax.random.normal(jax.random.key(i), s) * 0.1 for i, s in enumerate([(d, 96), (d, 96), (96, d)]))
    by_name = {
        name: grid
        for grid, name in launches(
            lambda *a: moe_experts(*a, impl="pallas", form="gemv", interpret=True, shared=shared)
        )
    }
    assert axes(by_name["moe_down_gemv"])[1] == d // down_n


def test_group_by_expert_matches_a_stable_sort():
    """Edge and random routings (up to 16 tokens, k up to 8 of up to 300 experts) against the grouping spelled
    out with a stable sort in numpy: the groups, their rows and every pair's row, exactly."""
    from pallas_kernels.moe.expert_gemv import GROUP_ROWS, group_by_expert

    rng = np.random.default_rng(0)
    cases = [  # edges: 16 tokens on the same k = E experts (row 15 used, every expert a group), k = 1, few experts
        (np.tile(np.arange(3), (GROUP_ROWS, 1)), 3), (rng.integers(0, 4, (GROUP_ROWS, 1)), 4),
        (np.stack([rng.permutation(5)[:2] for _ in range(GROUP_ROWS)]), 5),
    ]  # fmt: skip
    for _ in range(10):
        e = int(rng.integers(2, 300))
        k, n = int(rng.integers(1, min(e, 8) + 1)), int(rng.integers(1, GROUP_ROWS + 1))
        cases.append((np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), e))
    for idx, e in cases:
        idx = np.asarray(idx, np.int32)
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")
        touched = sorted(set(flat.tolist()))
        groups = min(n * k, e)
        e_ids = np.full(groups, -1)
        e_ids[: len(touched)] = touched
        row_token = np.full((groups, GROUP_ROWS), n)
        pair_at = np.zeros(n * k, np.int64)
        for p in order:  # pairs by expert, then token
            g = touched.index(flat[p])
            r = int((row_token[g] < n).sum())
            row_token[g, r] = p // k
            pair_at[p] = g * GROUP_ROWS + r
        got = group_by_expert(jnp.asarray(idx), e)
        assert np.asarray(got[0]).tolist() == e_ids.tolist()
        assert np.asarray(got[1]).tolist() == row_token.tolist()
        assert np.asarray(got[2]).tolist() == pair_at.reshape(n, k).tolist()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fs", [24, 40])  # 24 = F: one more program row per token in the same launches
def test_gemv_with_shared_expert(dtype, fs):
    """The shared expert beside the routed pairs (`moe_experts(shared=)`): the routed sum plus a SwiGLU of the
    shared weights rounded to x's dtype, through the GEMV kernels (still two launches when its width is F)
    and through the reference."""
    from pallas_kernels.moe.reference import swiglu_reference

    x, idx, w, gate, up, down = _case(5, 3, 40, 24, 9, 2, 0.0)
    ks = jax.random.split(jax.random.key(6), 3)
    shapes = [(40, fs), (40, fs), (fs, 40)]
    shared = tuple(jax.random.normal(kk, s) * s[0] ** -0.5 for kk, s in zip(ks, shapes, strict=True))
    x, gate, up, down = (a.astype(dtype) for a in (x, gate, up, down))
    shared = tuple(a.astype(dtype) for a in shared)
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference") + swiglu_reference(x, *shared)
    fn = lambda *a: moe_experts(*a, impl="pallas", form="gemv", block_n=16, block_k=16, interpret=True, shared=shared)  # noqa: E731
    got = fn(x, idx, w, gate, up, down)
    launches = str(jax.make_jaxpr(fn)(x, idx, w, gate, up, down)).count("pallas_call")
    assert launches == 2  # gate/up and down, the shared expert inside them or beside them through XLA
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(got, ref) < tol
    assert rel_err(moe_experts(x, idx, w, gate, up, down, impl="reference", shared=shared), ref) < 1e-6
    with pytest.raises(ValueError, match="shared expert weights"):
        moe_experts(x, idx, w, gate, up, down, shared=shared[:2])


@settings(max_examples=examples(3), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(2, 16),
    d=st.sampled_from([16, 48, 80]),
    f=st.sampled_from([16, 40, 32]),
    e=st.sampled_from([3, 9, 40]),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0]),
    split_k=st.sampled_from([None, 1, 2]),
)
def test_expert_gemv_matches_reference(seed, n, d, f, e, k, skew, split_k):
    """form="expert_gemv" (each touched expert's weights read once for all its rows) against the reference, for
    calls touching few experts (skew crowds the tokens onto the first ones) and more experts than pairs."""
    args = _case(seed, n, d, f, e, k, skew)
    ref = moe_experts(*args, impl="reference")
    got = moe_experts(*args, impl="pallas", form="expert_gemv", block_n=16, block_k=16, split_k=split_k, interpret=True)
    assert got.shape == ref.shape and np.isfinite(np.asarray(got)).all()
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("n, d, f, e, k", [(16, 200, 72, 32, 8), (16, 40, 24, 5, 3), (3, 130, 48, 32, 8)])
def test_expert_gemv_default_tiles_and_full_groups(n, d, f, e, k):
    """The default tiles on widths that are no multiple of them, a call of 16 tokens (the most a group holds)
    with every token on expert 0 (one group of 16 rows) beside its other k - 1 experts, and more pairs than
    experts (Kimi's k = 8 of 32)."""
    x, _, w, gate, up, down = _case(n + d, n, d, f, e, k, 0.0)
    others = 1 + jax.lax.top_k(jax.random.normal(jax.random.key(n), (n, e - 1)), k - 1)[1]  # distinct, never 0
    idx = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), others.astype(jnp.int32)], axis=1)  # expert 0 for all
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference")
    got = moe_experts(x, idx, w, gate, up, down, impl="pallas", form="expert_gemv", interpret=True)
    assert rel_err(got, ref) < 1e-5


def test_group_by_expert_rows_and_pairs():
    """Groups in ascending expert order, each group's rows in token order, padding rows naming token N, and each
    pair pointing at its own row; groups past the touched experts carry expert −1."""
    from pallas_kernels.moe.expert_gemv import GROUP_ROWS, group_by_expert

    idx = jnp.array([[3, 1], [1, 0], [3, 2]], jnp.int32)  # 3 tokens touch 4 of 9 experts in 6 pairs
    e_ids, row_token, pair_at = group_by_expert(idx, 9)
    assert e_ids.tolist() == [0, 1, 2, 3, -1, -1]
    assert [r[:3].tolist() for r in row_token[:4]] == [[1, 3, 3], [0, 1, 3], [2, 3, 3], [0, 2, 3]]
    assert (np.asarray(row_token[:, 3:]) == 3).all() and (np.asarray(row_token[4:]) == 3).all()
    expected = [[3 * GROUP_ROWS + 0, 1 * GROUP_ROWS + 0], [1 * GROUP_ROWS + 1, 0], [3 * GROUP_ROWS + 1, 2 * GROUP_ROWS]]
    assert pair_at.tolist() == expected
    with pytest.raises(ValueError, match="17 tokens > 16"):
        group_by_expert(jnp.zeros((17, 2), jnp.int32), 9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fs", [24, 40])  # 24 = F: the shared expert as one more group in the same launches
def test_expert_gemv_with_shared_expert_and_swiglu_limit(dtype, fs, monkeypatch):
    x, idx, w, gate, up, down = _case(7, 5, 40, 24, 9, 3, 0.0)
    ks = jax.random.split(jax.random.key(8), 3)
    shapes = [(40, fs), (40, fs), (fs, 40)]
    shared = tuple((jax.random.normal(kk, s) * s[0] ** -0.5).astype(dtype) for kk, s in zip(ks, shapes, strict=True))
    x, gate, up, down = (a.astype(dtype) for a in (x, gate, up, down))
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference", shared=shared, swiglu_limit=0.5)
    fn = lambda *a: moe_experts(  # noqa: E731
        *a, impl="pallas", form="expert_gemv", block_n=16, block_k=16, interpret=True, shared=shared, swiglu_limit=0.5
    )
    if fs == 24:  # the routed width: the shared expert must ride in the kernels, not run through XLA beside them
        monkeypatch.setattr(api, "swiglu_reference", lambda *a, **k: pytest.fail("shared expert ran through XLA"))
    got = fn(x, idx, w, gate, up, down)
    jaxpr = str(jax.make_jaxpr(fn)(x, idx, w, gate, up, down))
    assert "name=moe_gate_up_expert_gemv" in jaxpr and "name=moe_down_expert_gemv" in jaxpr
    assert jaxpr.count("pallas_call") == 2  # the shared expert inside both launches, or beside them in XLA
    assert rel_err(got, ref) < (1e-5 if dtype == jnp.float32 else 2e-2)


def test_expert_gemv_refuses_more_tokens_than_a_group_holds():
    args = _case(0, 17, 16, 16, 4, 2, 0.0)
    with pytest.raises(ValueError, match=r"form='expert_gemv' takes at most 16 tokens \(got 17\)"):
        moe_experts(*args, impl="pallas", form="expert_gemv", interpret=True)
