"""Train the embedded recall model (the `recall` preset) and write the checkpoint the package ships.

    python scripts/train_recall.py                      # the shipped run: writes hybrid_jax/assets/recall
    python scripts/train_recall.py --steps 5 --out /tmp/r   # a smoke run

Task: hybrid_jax/recall.py (`ab:17 cd:42 ?cd:` -> `42` EOS), 1-32 pairs, fresh pairs every step (a curriculum
raises the most pairs as the accuracy allows); the loss is the cross-entropy of the answer tokens. The lightning
indexer's Top-K passes no gradient, so the indexer learns by distillation, DeepSeek-V3.2's objective:
KL(p || softmax(I)) per query, p = the sparse layer's dense attention probabilities averaged over heads (held
constant), I = the indexer's scores. Unlike DeepSeek the indexer's inputs are not detached: the KL term (weight
0.1) also reaches the layers below it. Two phases: `--dense-steps` with the Top-K wide enough to keep every
position (the attention learns to retrieve and the indexer to imitate it), then the preset's Top-K (what
inference runs). Deterministic from --seed; needs optax (`pip install -e ".[train]"`). docs/recall.md has the
recipe; the run's curve and accuracy go to training.json beside the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax import inspect, recall
from hybrid_jax.config import HybridConfig
from hybrid_jax.model import HybridLM
from hybrid_jax.tokenizer import ByteTokenizer

# Queries per training sequence: after the first query's answer and EOS come up to QUERIES - 1 more
# (" ?ab:17<eos>"), each supervised the same way: ~3.8x the answer tokens a step for ~21% more tokens (pair
# counts uniform over 1-32). The first query is the inference format exactly.
QUERIES = 4
# (fewest pairs, most pairs, padded width): a batch draws its pair counts from one bucket, so that short prompts
# are not padded to the longest; buckets are drawn in proportion to their share of 1 .. 32 (uniform overall)
BUCKETS = ((1, 9, 96), (10, 20, 160), (21, 32, 224))


class Curriculum:
    """The most pairs a batch may hold: starts at --start-pairs and rises by 4 (up to --max-pairs) whenever the
    answer-token accuracy of the last 50 steps reaches 0.9 — the retrieval has formed at this length. A
    function of the losses, so as deterministic as they are."""

    def __init__(self, start: int, top: int):
        self.cap, self.top, self.since = min(start, top), top, 0

    def update(self, token_acc: list[float]) -> None:
        self.since += 1
        if self.cap < self.top and self.since >= 50 and np.mean(token_acc[-50:]) >= 0.9:
            self.cap, self.since = min(self.top, self.cap + 4), 0


def make_batch(rng: np.random.Generator, batch: int, cap: int):
    """ids [B, W] (BOS, prompt, answer, EOS, padding), targets [B, W] (the next token), weights [B, W] (1 on
    the three answer predictions), lengths [B] (tokens before the padding), for pair counts <= cap."""
    spans = [(lo, min(hi, cap), w) for lo, hi, w in BUCKETS if lo <= cap]
    sizes = np.array([hi - lo + 1 for lo, hi, _ in spans], np.float64)
    lo, hi, width = spans[int(rng.choice(len(spans), p=sizes / sizes.sum()))]
    tok = ByteTokenizer()
    ids = np.full((batch, width), tok.pad_id, np.int32)
    weights = np.zeros((batch, width), np.float32)
    lengths = np.zeros((batch,), np.int32)
    for b in range(batch):
        n = int(rng.integers(lo, hi + 1))
        q = recall.sample(rng, n)
        pairs = q.prompt[:-5].split()
        row = tok.encode(q.prompt)
        answers = [len(row) - 1]  # the positions that predict an answer's first digit
        row += [*q.answer.encode(), tok.eos_id]
        others = [p for p in pairs if p[:2] != q.prompt[-3:-1]]
        for i in rng.choice(len(others), size=min(QUERIES - 1, len(others)), replace=False):
            row += list(f" ?{others[i][:3]}".encode())
            answers.append(len(row) - 1)
            row += [*others[i][3:].encode(), tok.eos_id]
        ids[b, : len(row)] = row
        for a in answers:
            weights[b, a : a + recall.ANSWER_TOKENS] = 1.0
        lengths[b] = len(row)
    return ids, np.roll(ids, -1, axis=1), weights, lengths


def indexer_kl(records, lengths) -> jax.Array:
    """Mean over sparse layers and real query positions of KL(dense attention || softmax(indexer scores))."""
    total = []
    for rec in records:
        if rec.get("shared") or "q" not in rec:
            continue
        q, k, w = rec["q"].astype(jnp.float32), rec["k"].astype(jnp.float32), rec["weights"]
        scores = jnp.einsum("btnh,bsh->btns", q, k) * rec["scale"]
        scores = jnp.einsum("btns,btn->bts", jax.nn.relu(scores), w)
        s = scores.shape[-1]
        causal = jnp.arange(s)[None, None, :] <= rec["positions"][:, :, None]
        logp_index = jax.nn.log_softmax(jnp.where(causal, scores, -1e30), axis=-1)
        target = jax.lax.stop_gradient(jnp.mean(rec["attention"][..., :s], axis=1))  # [B, T, S]
        kl = jnp.sum(jnp.where(target > 0, target * (jnp.log(jnp.maximum(target, 1e-30)) - logp_index), 0.0), -1)
        real = jnp.arange(kl.shape[1])[None, :] < lengths[:, None]
        total.append(jnp.sum(kl * real) / jnp.sum(real))
    return sum(total) / len(total) if total else jnp.zeros(())


def build_step(graphdef, optimizer, kl_weight: float):
    """A jitted training step for the model structure `graphdef` (the parameters are shared by every structure:
    the dense phase's only differs in its Top-K): (params, rest, opt_state, batch) -> (params, opt_state,
    (cross-entropy, indexer KL, answer-token accuracy))."""
    import optax

    def loss_fn(params, rest, ids, targets, weights, lengths):
        model = nnx.merge(graphdef, params, rest)
        with inspect.record_indexer(traced=True) as records:
            logits = model(ids)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        ce = jnp.sum(nll * weights) / jnp.sum(weights)
        kl = indexer_kl(records, lengths)
        right = jnp.argmax(logits, -1) == targets
        return ce + kl_weight * kl, (ce, kl, jnp.sum(right * weights) / jnp.sum(weights))

    @jax.jit
    def step(params, rest, opt_state, ids, targets, weights, lengths):
        grads, aux = jax.grad(loss_fn, has_aux=True)(params, rest, ids, targets, weights, lengths)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux

    return step


def evaluate(model: HybridLM, seed: int, per_count: int, max_pairs: int) -> dict[int, float]:
    """Teacher-forced accuracy (both digits and EOS right) by number of pairs, on fresh queries."""
    rng = np.random.default_rng(seed)
    fwd = nnx.jit(lambda m, ids: m(ids))
    acc = {}
    for n in range(1, max_pairs + 1):
        ids, targets, weights, _ = make_batch_fixed(rng, per_count, n)
        logits = np.asarray(fwd(model, jnp.asarray(ids)))
        right = (logits.argmax(-1) == targets) | (weights == 0)
        acc[n] = float(right.all(axis=1).mean())
    return acc


def make_batch_fixed(rng, batch: int, num_pairs: int):
    qs = [recall.sample(rng, num_pairs) for _ in range(batch)]
    ids, plen = recall.encode_batch(qs, with_answers=True, width=BUCKETS[-1][2])
    targets = np.roll(ids, -1, axis=1)
    cols = np.arange(ids.shape[1])[None, :]
    weights = ((cols >= plen[:, None] - 1) & (cols < plen[:, None] - 1 + recall.ANSWER_TOKENS)).astype(np.float32)
    return ids, targets, weights, plen


def write_checkpoint(model: HybridLM, out: Path, meta: dict) -> None:
    """config.json + model.safetensors (our `hybrid` format) + tokenizer.json + training.json, written to a
    temporary folder beside `out` and renamed into place; a previous checkpoint is renamed aside first and removed
    only once the new one is in place (put back if that rename fails), so a failed run leaves it whole."""
    from checkpoints import save_pretrained

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    os.chmod(tmp, 0o755)  # a package folder, not a private temporary one
    old = out.parent / f".{out.name}-previous"
    try:
        save_pretrained(model, tmp)
        ByteTokenizer().to_tokenizers().save(str(tmp / "tokenizer.json"))
        (tmp / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            if old.exists() and not out.exists():
                os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1450)
    p.add_argument("--dense-steps", type=int, default=850, help="steps with a Top-K that keeps every position")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--kl-weight", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-pairs", type=int, default=recall.MAX_PAIRS)
    p.add_argument("--start-pairs", type=int, default=6, help="the curriculum's first most pairs a prompt holds")
    p.add_argument("--eval-every", type=int, default=100, help="print (and record) the running losses every N steps")
    p.add_argument("--eval-queries", type=int, default=64, help="fresh queries per pair count in the final evaluation")
    p.add_argument("--out", type=Path, default=recall.MODEL_DIR)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "max_pairs", "eval_every", "eval_queries"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.max_pairs > BUCKETS[-1][1]:
        p.error(f"--max-pairs {args.max_pairs} must be at most {BUCKETS[-1][1]}")
    if not 0 <= args.dense_steps <= args.steps:
        p.error(f"--dense-steps {args.dense_steps} must lie in [0, --steps {args.steps}]")
    try:
        import optax
    except ImportError:
        p.error("needs optax: pip install -e '.[train]'")

    cfg = HybridConfig.recall()
    model = HybridLM(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # the dense phase: per bucket width, a Top-K that keeps every earlier position (same parameters)
    dense = {w: nnx.graphdef(HybridLM(cfg.replace(index_topk=w), rngs=nnx.Rngs(0))) for _, _, w in BUCKETS}
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(200, args.steps // 4), args.steps, args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.98, weight_decay=0.01))
    opt_state = optimizer.init(params)
    sparse_step = build_step(graphdef, optimizer, args.kl_weight)
    dense_steps = {w: build_step(g, optimizer, args.kl_weight) for w, g in dense.items()}
    rng = np.random.default_rng(args.seed)
    t0, hist, curve = time.time(), [], []
    curriculum = Curriculum(args.start_pairs, args.max_pairs)
    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc="train", file=sys.stdout, mininterval=5)
    for i in bar:
        batch = [jnp.asarray(x) for x in make_batch(rng, args.batch, curriculum.cap)]
        step = dense_steps[batch[0].shape[1]] if i < args.dense_steps else sparse_step
        params, opt_state, (ce, kl, right) = step(params, rest, opt_state, *batch)
        hist.append((float(ce), float(kl), float(right)))
        curriculum.update([h[2] for h in hist])
        if (i + 1) % 50 == 0:
            ce_m, kl_m, acc_m = np.mean(hist[-50:], axis=0)
            bar.set_postfix_str(f"ce {ce_m:.3f} kl {kl_m:.3f} acc {acc_m:.2f} pairs <= {curriculum.cap}")
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            ce_m, kl_m, acc_m = np.mean(hist[-min(50, args.eval_every) :], axis=0)
            curve.append(dict(step=i + 1, ce=round(float(ce_m), 4), kl=round(float(kl_m), 4),
                              acc=round(float(acc_m), 3), max_pairs=curriculum.cap))  # fmt: skip
            tqdm.write(f"step {i + 1}: ce {ce_m:.4f}  indexer kl {kl_m:.4f}  answer-token acc {acc_m:.3f}  "
                       f"pairs <= {curriculum.cap}  ({time.time() - t0:.0f} s)",
                       file=sys.stdout)  # fmt: skip
    model = nnx.merge(graphdef, params, rest)
    acc = evaluate(model, args.seed + 1, args.eval_queries, args.max_pairs)
    print("accuracy by pairs (teacher-forced, Top-K of the preset):")
    print("  " + "  ".join(f"{n}:{a:.2f}" for n, a in acc.items()))
    meta = dict(
        seed=args.seed, steps=args.steps, dense_steps=args.dense_steps, batch=args.batch, lr=args.lr,
        kl_weight=args.kl_weight, max_pairs=args.max_pairs, seconds=round(time.time() - t0),
        curve=curve, accuracy_by_pairs=acc,
    )  # fmt: skip
    write_checkpoint(model, args.out, meta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
