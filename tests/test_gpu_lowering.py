"""The Triton lowering of kernels on a CPU-only machine: kernels traced and lowered for an abstract
NVIDIA H200 (`lowering_platforms=("cuda",)`), which runs Pallas's Triton lowering (jaxpr -> Triton IR) without
a GPU. Interpret-mode tests check the values; this catches kernels that use an operation the Triton lowering
does not support (e.g. a value slice or a general concatenate) before a GPU run does. Triton's own compilation
(to PTX) still happens only on a GPU."""

import jax
import jax.numpy as jnp
import pytest

mesh_lib = pytest.importorskip("jax._src.mesh")  # AbstractDevice is private: skip if it moves


def _lowered_for_h200(fn, *args, axis_types=None) -> str:
    from benchmarks.kernel_resources import lower_for_h200

    return lower_for_h200(fn, *args, axis_types=axis_types).as_text()


@pytest.mark.parametrize("rows", [1, 5])
def test_projection_kernel_lowers(rows):
    from pallas_kernels.projection import project

    x, w = jnp.ones((rows, 2304), jnp.bfloat16), jnp.ones((2304, 4096), jnp.bfloat16)
    text = _lowered_for_h200(lambda x, w: project(x, w, impl="pallas", interpret=False), x, w)
    assert text.count("xla.gpu.triton") == 1


def test_projection_group_lowers():
    """A KDA layer's five input projections as one launch (one row padded in the kernel)."""
    from pallas_kernels.projection import project_group

    x = jnp.ones((1, 1536), jnp.bfloat16)
    ws = [jnp.ones((1536, n), jnp.bfloat16) for n in (1536, 1536, 1536, 128, 128)]
    text = _lowered_for_h200(lambda x, *ws: project_group(x, ws, impl="pallas", interpret=False), x, *ws)
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("solve, state_every", [("neumann", None), ("substitution", None), ("neumann", 128)])
def test_kda_prefill_kernels_lower(solve, state_every):
    """state_every: the state pass also stores the state at every 128 tokens (3 snapshots of 384 tokens)."""
    from pallas_kernels.linear_attention.chunked import kda_chunked_pallas

    t, n, dk = 384, 2, 128
    q = jnp.ones((1, t, n, dk), jnp.bfloat16)
    g = jnp.ones((1, t, n, dk), jnp.float32)
    beta = jnp.ones((1, t, n), jnp.float32)
    s0 = jnp.zeros((1, n, dk, dk), jnp.float32)

    def run(q, g, beta, s0):
        return kda_chunked_pallas(
            q, q, q, g, beta, s0, scale=0.1, l2norm=True, block_v=32, precision="bf16", solve=solve,
            state_every=state_every,
        )  # fmt: skip

    lowered = jax.jit(run).trace(q, g, beta, s0)
    assert len(jax.tree.leaves(lowered.out_info)) == (2 if state_every is None else 3)
    assert _lowered_for_h200(run, q, g, beta, s0).count("xla.gpu.triton") == 4  # cumsum, A, solve, state pass


def test_kda_a_kernel_lowers_to_unrolled_products():
    """The A kernel on sm_90: its 13 tensor-core products (the undecayed diagonal, two per level of the binary
    split) unrolled, no loop: a form looping over (level, column block) pairs compiled to fewer registers and
    ran 1.35-3x slower (docs/performance.md#kda-prefill)."""
    from benchmarks.kernel_resources import triton_kernels
    from pallas_kernels.linear_attention.chunked import _intra

    t, n, dk = 128, 2, 128
    q = jnp.ones((1, t, n, dk), jnp.bfloat16)
    g = jnp.ones((1, t, n, dk), jnp.float32)
    beta = jnp.ones((1, t, n), jnp.float32)

    def run(q, g, beta):
        return _intra(q, q, q, g, beta, scale=0.1, l2norm=True, precision="bf16", interpret=False)

    kernels = {k["name"]: k for k in triton_kernels(run, q, g, beta)}
    assert set(kernels) == {"kda_chunk_cumsum", "kda_chunk_a", "kda_chunk_solve"}
    ttir = kernels["kda_chunk_a"]["ttir"]
    assert ttir.count("scf.for") == 0 and ttir.count("tt.dot") == 13


def test_kda_a_kernel_block_forms_lower_as_branches():
    """a_blocks=(64, 16): the A kernel compiles the 64-row block form (2 products), the 16-row one (2 + 2 levels
    x 2 = 6) and the binary split (13) as runtime branches on each chunk's span, no loop."""
    from benchmarks.kernel_resources import triton_kernels
    from pallas_kernels.linear_attention.chunked import _intra

    q = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
    g = jnp.ones((1, 128, 2, 128), jnp.float32)
    beta = jnp.ones((1, 128, 2), jnp.float32)

    def run(q, g, beta):
        return _intra(q, q, q, g, beta, scale=0.1, l2norm=True, precision="bf16", interpret=False, a_blocks=(64, 16))

    kernels = {k["name"]: k for k in triton_kernels(run, q, g, beta)}
    assert "kda_chunk_cumsum" in kernels
    ttir = kernels["kda_chunk_a"]["ttir"]
    assert ttir.count("scf.for") == 0 and ttir.count("scf.if") == 2 and ttir.count("tt.dot") == 21


@pytest.mark.parametrize("precision,stages", [("bf16", "3"), ("tf32", "1")])
def test_kda_state_pass_stages_follow_the_products_precision(precision, stages):
    """float32 intermediates: the state pass unpipelined (3 stages asked sm_90 for 385,024 bytes of shared
    memory, 2 for 262,144; a block may have 232,448)."""
    import re

    from pallas_kernels.linear_attention.chunked import kda_chunked_pallas

    q = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
    g = jnp.ones((1, 128, 2, 128), jnp.float32)
    beta = jnp.ones((1, 128, 2), jnp.float32)
    s0 = jnp.zeros((1, 2, 128, 128), jnp.float32)

    def run(q, g, beta, s0):
        return kda_chunked_pallas(q, q, q, g, beta, s0, scale=0.1, l2norm=True, block_v=32, precision=precision)

    text = _lowered_for_h200(run, q, g, beta, s0)
    assert re.findall(r'name = "kda_chunk_state", num_stages = (\d+)', text) == [stages]


@pytest.mark.parametrize("cu", [(0, 70, 70, 200), (0, 5, 40)])
def test_kda_packed_prefill_kernels_lower(cu):
    """Packed sequences: the state pass is one program per (sequence, head, V-block) whose loop bounds are
    read from memory (a counted loop with a dynamic trip count), storing o masked at the sequence's rows (also
    where all the sequences hold fewer tokens than one chunk)."""
    import numpy as np

    from pallas_kernels.linear_attention import kda

    cu = np.array(cu)
    t, n_seq = int(cu[-1]), len(cu) - 1
    q = jnp.ones((1, t, 2, 128), jnp.bfloat16)
    g = jnp.ones((1, t, 2, 128), jnp.float32)
    beta = jnp.ones((1, t, 2), jnp.float32)
    s0 = jnp.zeros((n_seq, 2, 128, 128), jnp.float32)

    def run(q, g, beta, s0):
        return kda(q, q, q, g, beta, initial_state=s0, cu_seqlens=cu, impl="pallas", interpret=False)

    assert _lowered_for_h200(run, q, g, beta, s0).count("xla.gpu.triton") == 4


def test_kda_decode_step_kernel_lowers():
    from pallas_kernels.linear_attention import kda_decode_step

    b, n, dk = 2, 4, 128
    q = jnp.ones((b, n, dk), jnp.bfloat16)
    state = jnp.zeros((b, n, dk, dk), jnp.float32)

    def run(q, state):
        return kda_decode_step(q, q, q, q.astype(jnp.float32), jnp.ones((b, n)), state, impl="pallas", interpret=False)

    assert _lowered_for_h200(run, q, state).count("xla.gpu.triton") == 1


@pytest.mark.parametrize("form,tokens", [("grouped", 40), ("gemv", 1), ("expert_gemv", 5)])
@pytest.mark.parametrize("swiglu_limit", [None, 7.0])  # 7.0: the clamped SwiGLU's min / max in the kernels
def test_moe_kernels_lower(form, tokens, swiglu_limit):
    from pallas_kernels.moe import moe_experts

    e, d, f, k = 8, 256, 128, 2
    x = jnp.ones((tokens, d), jnp.bfloat16)
    idx = jnp.zeros((tokens, k), jnp.int32).at[:, 1].set(1)
    w = jnp.full((tokens, k), 0.5, jnp.float32)
    gate = jnp.ones((e, d, f), jnp.bfloat16)
    down = jnp.ones((e, f, d), jnp.bfloat16)

    def run(x, idx, w, gate, down):
        return moe_experts(
            x, idx, w, gate, gate, down, impl="pallas", form=form, interpret=False, swiglu_limit=swiglu_limit
        )

    assert _lowered_for_h200(run, x, idx, w, gate, down).count("xla.gpu.triton") >= 1


def test_moe_prefill_tiles_take_fewer_stages_for_float32():
    """128-row blocks: 3 pipeline stages for bf16, at most WIDE_OPERAND_MAX_STAGES for float32 operands,
    whose 3 stages overflowed the H200's shared memory (no float32 model ran); given stages are kept."""
    import re

    from pallas_kernels.moe import api, moe_experts

    def stages(dtype, **kw):
        x, w = jnp.ones((512, 256), dtype), jnp.ones((512, 2), jnp.float32)
        idx = jnp.zeros((512, 2), jnp.int32).at[:, 1].set(1)
        gate, down = jnp.ones((8, 256, 128), dtype), jnp.ones((8, 128, 256), dtype)
        run = lambda *a: moe_experts(*a, impl="pallas", interpret=False, block_m=128, **kw)  # noqa: E731
        return set(re.findall(r"num_stages = (\d+)", _lowered_for_h200(run, x, idx, w, gate, gate, down)))

    assert stages(jnp.bfloat16) == {str(api.PREFILL_TILES["num_stages"])} == {"3"}
    assert stages(jnp.float32) == {str(api.WIDE_OPERAND_MAX_STAGES)}
    assert stages(jnp.float32, num_stages=3) == {"3"}


@pytest.mark.parametrize("dims", [(64, 64), (192, 128)])
def test_attention_kernel_lowers(dims):
    from pallas_kernels.attention import attention

    (b, t, n), (h, hv) = (1, 256, 4), dims  # 192: the MLA prefill's q/k, read as 128 + 64 pieces
    q = jnp.ones((b, t, n, h), jnp.bfloat16)
    v = jnp.ones((b, t, n, hv), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def run(q, v, pos):
        return attention(q, q, v, q_positions=pos, kv_lengths=jnp.full((b,), t, jnp.int32), scale=0.125,
                         impl="pallas", interpret=False)  # fmt: skip

    assert _lowered_for_h200(run, q, v, pos).count("xla.gpu.triton") == 1


@pytest.mark.parametrize("pool_format", ["bf16", "mxfp8"])
@pytest.mark.parametrize(
    ("t", "keys_per_program", "select"),
    [(1, None, "kernel"), (1, 256, "kernel"), (64, None, "kernel"), (1, 256, "split")],  # 64: the tiled kernel
)
def test_indexer_kernel_lowers(pool_format, t, keys_per_program, select):
    from pallas_kernels.indexer import indexer_topk

    b, n, h, page, pages = 2, 16, 128, 64, 8
    q = jnp.ones((b, t, n, h), jnp.bfloat16)
    w = jnp.ones((b, t, n), jnp.float32)
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    pos = jnp.full((b, t), page * pages - 1, jnp.int32)
    kv = jnp.full((b,), page * pages, jnp.int32)
    pool = jnp.ones((b * pages, page, h), jnp.bfloat16 if pool_format == "bf16" else jnp.float8_e4m3fn)
    scales = None if pool_format == "bf16" else jnp.full((b * pages, page, h // 32), 127, jnp.uint8)

    def run(q, w, pool, table, pos, kv):
        k_scales = None if scales is None else jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu)
        return indexer_topk(
            q, w, pool, table, q_positions=pos, kv_lengths=kv, topk=64, scale=0.1, impl="pallas", k_scales=k_scales,
            keys_per_program=keys_per_program, select=select, interpret=False,
        )  # fmt: skip

    # scores, then the selection kernel; or the scores with their statistics, then count, compact and the
    # best-first ranking (which cuts a row of more than 2k candidates itself: no one-program select launch)
    launches = 2 if select == "kernel" else 4
    assert _lowered_for_h200(run, q, w, pool, table, pos, kv).count("xla.gpu.triton") == launches


def test_prefiltered_selection_lowers():
    from pallas_kernels.indexer.select_kernel import top_k_rows_pallas

    x = jnp.ones((4, 8192), jnp.float32)

    def run(x, limits):
        return top_k_rows_pallas(x, limits, k=256, chunk=1024, prefilter=True)

    assert _lowered_for_h200(run, x, jnp.full((4,), 8000, jnp.int32)).count("xla.gpu.triton") == 2


@pytest.mark.parametrize("best_first", [False, True])
def test_split_selection_lowers(best_first):
    """The split selection's four kernels at a decode shape (one 128K row: 128 programs on each pass), and
    the reductions of its bound choice (an iota-masked whole-tile sum fails to lower under an explicit mesh);
    best first, the candidates' ranking (with its own K-th key search) in place of the one-program select."""
    from pallas_kernels.indexer.select_split import top_k_split

    x = jnp.ones((1, 131072), jnp.float32)

    def run(x, limits):
        return top_k_split(x, limits, k=2048, chunk=4096, best_first=best_first)

    text = _lowered_for_h200(run, x, jnp.full((1,), 131000, jnp.int32))
    assert text.count("xla.gpu.triton") == 4
    assert ("indexer_split_rank" in text) == best_first


@pytest.mark.parametrize("knobs,rope", [({}, 64), ({"block_h": 32, "num_warps": 8}, 64), ({}, 0)])
def test_sparse_mla_kernel_lowers(knobs, rope):
    """rope 0: GLM-5.3-Flash's NoPE DSA, the kernel without a rope query or pool."""
    from pallas_kernels.sparse_attention import sparse_mla

    b, t, n, lat, page, pages, k = 2, 1, 32, 512, 64, 4, 128
    ql = jnp.ones((b, t, n, lat), jnp.bfloat16)
    qr = jnp.ones((b, t, n, rope), jnp.bfloat16)
    pool = jnp.ones((b * pages, page, lat + rope), jnp.bfloat16)
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, t, k))

    def run(ql, qr, pool, table, idx):
        return sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="pallas", interpret=False, **knobs)

    assert _lowered_for_h200(run, ql, qr, pool, table, idx).count("xla.gpu.triton") >= 1


@pytest.mark.parametrize("precision,rope", [("tf32", 64), ("bf16", 64), ("bf16", 0)])
def test_sparse_mla_fp8_kernel_lowers(precision, rope):
    from hybrid_jax.quant.formats import quantize_kv_fp8
    from pallas_kernels.sparse_attention import sparse_mla

    b, t, n, lat, page, pages, k = 2, 1, 16, 512, 64, 4, 128
    ql = jnp.ones((b, t, n, lat), jnp.bfloat16)
    qr = jnp.ones((b, t, n, rope), jnp.bfloat16)
    values, scales = quantize_kv_fp8(jnp.ones((b * pages, page, lat)), 128)
    rope_pages = jnp.ones((b * pages, page, rope), jnp.bfloat16)
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, t, k))

    def run(ql, qr, values, scales, rope_pages, table, idx):
        return sparse_mla(ql, qr, values, table, idx, scale=0.1, impl="pallas", interpret=False, precision=precision,
                          latent_scales=scales, rope_pages=rope_pages if rope else None)  # fmt: skip

    text = _lowered_for_h200(run, ql, qr, values, scales, rope_pages, table, idx)
    assert text.count("xla.gpu.triton") == 1 and "sparse_mla_fp8" in text  # decode-sized: the FP8-row kernel


@pytest.mark.parametrize("d, e", [(2304, 32), (4096, 288)])  # Kimi-Linear; GLM-5.3-Flash (padded to 512)
def test_moe_router_kernel_lowers(d, e):
    from pallas_kernels.moe import moe_route

    x = jnp.ones((1, d), jnp.bfloat16)
    w = jnp.ones((d, e), jnp.bfloat16)
    bias = jnp.zeros((e,), jnp.float32)
    text = _lowered_for_h200(lambda x, w, b: moe_route(x, w, b, k=8, impl="pallas", interpret=False), x, w, bias)
    assert text.count("xla.gpu.triton") == 2  # the logits' GEMV, the selection


@pytest.mark.parametrize("swiglu_limit", [None, 7.0])
def test_moe_gemv_with_shared_expert_lowers(swiglu_limit):
    from pallas_kernels.moe import moe_experts

    d, f, e, k = 256, 128, 8, 2
    x = jnp.ones((1, d), jnp.bfloat16)
    idx = jnp.zeros((1, k), jnp.int32)
    w = jnp.ones((1, k), jnp.float32)
    gate = jnp.ones((e, d, f), jnp.bfloat16)
    down = jnp.ones((e, f, d), jnp.bfloat16)
    shared = (jnp.ones((d, f), jnp.bfloat16),) * 2 + (jnp.ones((f, d), jnp.bfloat16),)

    def run(x, idx, w, gate, down):
        return moe_experts(
            x, idx, w, gate, gate, down, impl="pallas", form="gemv", interpret=False, shared=shared,
            swiglu_limit=swiglu_limit,
        )  # fmt: skip

    text = _lowered_for_h200(run, x, idx, w, gate, down)
    assert text.count("xla.gpu.triton") == 2
    # only the down partials: gate/up are combined (and clamped, with a limit) in the down kernel
    assert text.count("stablehlo.reduce") == 1


def test_kda_decode_layer_kernel_lowers():
    from pallas_kernels.linear_attention import kda_decode_layer
    from tests.test_kda_decode_layer import _inputs

    args = _inputs(0, 2, 4, 128, 4, False, jnp.bfloat16)

    def run(*a):
        return kda_decode_layer(*a, num_heads=4, head_dim=128, impl="pallas", interpret=False)

    assert _lowered_for_h200(run, *args).count("xla.gpu.triton") == 1


@pytest.mark.parametrize("nk", [None, 2])
def test_kda_verify_layer_kernel_lowers(nk):
    """The verify block kernel (5 tokens: the snapshots' blocks have no power-of-two length), both layouts."""
    from pallas_kernels.linear_attention import kda_verify_layer
    from tests.test_kda_decode_layer import _block

    args = _block(0, 1, 5, 4, 128, 4, False, jnp.bfloat16, nk)

    def run(*a):
        return kda_verify_layer(*a, num_heads=4, head_dim=128, num_k_heads=nk, impl="pallas", interpret=False)

    assert _lowered_for_h200(run, *args).count("xla.gpu.triton") == 1


def test_kda_decode_layer_kernel_lowers_with_split_k_inputs():
    """Batch 1 as the model runs it: the projections as split-K partial sums (3 and 2 partials: counts that
    are no power of two) read by the layer kernel, the second projections reading the first's."""
    from pallas_kernels.linear_attention import kda_decode_layer
    from pallas_kernels.projection import project_group
    from tests.test_kda_decode_layer import _inputs

    n, hd = 16, 128
    c = n * hd
    args = list(_inputs(0, 1, n, hd, 4, False, jnp.bfloat16))
    x = jnp.ones((1, 1, 768), jnp.bfloat16)
    ws = [jnp.ones((768, m), jnp.bfloat16) for m in (c, c, c, 128, 128)]
    wb = jnp.ones((768, n), jnp.bfloat16)
    w2 = [jnp.ones((128, c), jnp.bfloat16)] * 2

    def run(x, ws, wb, w2, args):
        q, k, v, fa, za, b = project_group(x, [*ws, wb], impl="pallas", interpret=False, lazy=True, split_k=3)
        f, z = project_group([fa, za], w2, impl="pallas", interpret=False, lazy=True)
        a = list(args)
        a[0], a[1], a[2], a[5], a[8], a[9] = q, k, v, f, b, z
        return kda_decode_layer(*a, num_heads=n, head_dim=hd, impl="pallas", interpret=False)

    text = _lowered_for_h200(run, x, ws, wb, w2, args)
    assert text.count("xla.gpu.triton") == 3  # two projection launches (β in a padded tile) and the layer
    assert "stablehlo.reduce" not in text  # no partial sums added between them


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_kernel_lowers(residual):
    from pallas_kernels.norm import rms_norm

    x = jnp.ones((1, 2304), jnp.bfloat16)
    w = jnp.ones((2304,), jnp.bfloat16)

    def run(x, w):
        return rms_norm(x, w, eps=1e-6, residual=x if residual else None, impl="pallas", interpret=False)

    assert _lowered_for_h200(run, x, w).count("xla.gpu.triton") == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, quant, batch",
    [
        ("hybrid_small", "none", 1),
        ("hybrid_small", "none", 16),
        ("hybrid_small", "hierarchical", 64),
        ("kimi_linear_48b", "none", 64),
        ("deepseek_v32", "none", 1),
    ],
)
def test_decode_step_has_no_device_loop(preset, quant, batch, monkeypatch):
    """A whole decode step as the GPU runs it (the kernels and paths `impl="auto"` picks on a GPU, for an
    abstract model and cache: nothing allocated) holds no `while`: on a GPU each iteration of one copies its
    predicate to the host, a round trip inside the step (01ab786: `searchsorted`'s loop in every MoE layer
    cost 0.58 ms of a hybrid_small B=64 step; this test fails on the code before it)."""
    from flax import nnx

    from benchmarks.e2e import build_model

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the GPU defaults, not interpret mode
    model = nnx.eval_shape(lambda: build_model(preset, quant))  # as the e2e benchmark builds it, abstract
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, 2048 + 64))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def step(state, ids, cache):
        return nnx.merge(graphdef, state).decode_step(ids, cache)

    # Auto axes: XLA's sharding propagation, as on a real device (ragged_dot has no explicit-axes rule)
    text = _lowered_for_h200(step, state, ids, cache, axis_types=(jax.sharding.AxisType.Auto,))
    assert "xla.gpu.triton" in text  # the step's kernels were picked
    assert "stablehlo.while" not in text
