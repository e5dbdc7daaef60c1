"""Prefix caching for hybrid models: paged pools shared by reference, recurrent states restored from snapshots.

A `PrefixCache` owns one pool of pages per attention layer (the pages of the caches it lends out) and cuts it
into *blocks* of `block_size` tokens (a multiple of the page size): block slot s owns pages
[s * n, (s + 1) * n), n = block_size / page_size. A stored block is one full block of some prompt, keyed by its
tokens and its parent (the slot of the block before it; -1 for a prompt's first block), so a chain of slots is
one prefix and matching is exact (tokens compared, no hashes). With each block the cache keeps the state every
per-sequence leaf had after the block's last token: the KDA recurrent state and conv tail, the KPool indexer's
tail. A state is the prefix's whole past, so a recurrent layer can resume only at a snapshot; at Kimi-Linear
widths one snapshot is ~2 MiB per KDA layer, which is why blocks are thousands of tokens, not a page.

`prefill(model, ids, lengths, max_len=...)`:
  1. lookup: each row follows the longest chain of stored blocks equal to its prompt's leading blocks (at most
     (length - 1) // block_size of them: the last prompt token is always computed, its logits are the output);
  2. allocation: each row takes ceil(max_len / block_size) slots, its matched ones (shared by reference: the
     row's page table points at them; nothing is copied) and fresh ones for the rest: free slots first, then the
     least recently used stored blocks not matched in this call (deepest first among equals, so a chain loses its
     tail before its head; a block whose parent is evicted is dropped with it);
  3. the per-sequence states start from the snapshot of each row's last matched block (zeros without a hit), the
     cache length at the matched tokens; the rest of the prompt is prefilled in calls of `chunk` tokens (whole
     blocks) that return the states at every block end inside them, then block calls, then the partial last
     block in calls of `tail_chunk` tokens (each size a `lax.while_loop`, as chunked prefill runs), the states
     after every full block written to that block's slot;
  4. registration: every full prompt block not matched becomes a stored block (a block an earlier row of the
     same call already stored is not stored twice: the row keeps its private copy, later blocks chain to the
     stored one).
A row never writes into a shared block: shared blocks are full and lie before the row's first new token, and a
speculative rollback clears only positions at or past the row's length; so no page ever needs copying on write.

The page pools are lent to the cache `prefill` returns (the returned PrefixCache holds none meanwhile, so two
caches can never write the same pool); `release(cache)` takes them back once decoding is done. `generate(...,
prefix_cache=pc)` does all of this and returns the updated cache in `GenerateOutput.prefix_cache`.
Everything is a pure function of arrays: the cache is a pytree, usable under `jax.jit` (donate it to reuse its
memory). Results never depend on hits: a hit resumes from the exact state a miss would have computed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.cache import AttnState, HybridCache, KDAState, MLAState, is_concrete
from hybrid_jax.generate import default_prefill_chunk, default_tail_chunk, prefill_calls, prefill_in_two_sizes

# Default tokens per block: a KDA snapshot per block costs (layers x heads x K x V x 4 bytes) / block_size
# bytes per cached token (~20 KiB at Kimi-Linear-48B widths), against ~8 KiB of MLA pages; a block of this many
# tokens is also a prefill chunk that keeps the GPU busy.
DEFAULT_BLOCK_TOKENS = 2048

# Counters are kept as two int32 limbs (value = hi * 2**LIMB + lo), exact to 2**51 without 64-bit mode.
LIMB = 20
COUNTERS = ("hit_tokens", "miss_tokens", "evictions")


def default_block_size(model) -> int:
    g = model.config.page_size
    return max(g, DEFAULT_BLOCK_TOKENS // g * g)


def _model_key(model) -> tuple:
    """What a cache's contents depend on besides the weights: the config, the compute dtype, the quantization."""
    return (model.config, jnp.dtype(model.dtypes.compute).name, repr(model.quant))


def _weights_mark(model) -> jax.Array:
    """A uint32 checksum of the bits of up to 256 leading elements of every parameter: the same weights give the
    same mark under any compilation (an integer sum is exact in any order); other weights of the same config
    almost surely do not, unless they agree in all of these elements (a fine-tune that froze most tensors and
    changed the rest only past their first 256 values would pass)."""
    total = jnp.uint32(0)
    for i, leaf in enumerate(jax.tree.leaves(nnx.state(model, nnx.Param))):
        x = jnp.ravel(leaf)[:256].astype(jnp.float32)
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        w = (jnp.arange(1, x.size + 1, dtype=jnp.uint32) + jnp.uint32(i * 7919)) * jnp.uint32(2654435761)
        total = total + jnp.sum(bits * w, dtype=jnp.uint32)
    return total


def _per_seq(state):
    """The per-sequence leaves of a layer's cache state (what a snapshot holds)."""
    if isinstance(state, KDAState):
        return (state.conv, state.recurrent)
    if isinstance(state, AttnState):  # gated GQA: pools only
        return None
    return state.index_tail


def _with_per_seq(state, leaves, pools_from=None):
    """`state` with its per-sequence leaves replaced (and, for attention layers, its pools from `pools_from`)."""
    if isinstance(state, KDAState):
        return KDAState(conv=leaves[0], recurrent=leaves[1])
    src = state if pools_from is None else pools_from
    if isinstance(state, AttnState):
        return AttnState(k=src.k, v=src.v)
    return MLAState(latent=src.latent, rope=src.rope, index_k=src.index_k, index_tail=leaves)


def _add(counter: jax.Array, x: jax.Array) -> jax.Array:
    lo = counter[1] + x.astype(jnp.int32)
    return jnp.stack([counter[0] + (lo >> LIMB), lo & ((1 << LIMB) - 1)])


@jax.tree_util.register_pytree_node_class
class PrefixCache:
    """Page-aligned prefixes of earlier prompts with their recurrent-state snapshots, for one model.

    `PrefixCache(model, max_tokens=...)` holds pages for `max_tokens` tokens (rounded down to whole blocks):
    the stored prefixes *and* the caches of the sequences it prefills (a batch of B rows up to max_len tokens
    needs B x ceil(max_len / block_size) blocks of it), plus one state snapshot per block. See the module
    docstring for the algorithm; `generate(model, ids, prefix_cache=pc)` is the usual entry point.
    """

    def __init__(
        self, model, max_tokens: int, *, block_size: int | None = None, tail_chunk: int | None = None, dtype=None
    ):
        cfg = model.config
        g = cfg.page_size
        blk = default_block_size(model) if block_size is None else block_size
        if not isinstance(blk, (int, np.integer)) or isinstance(blk, bool) or blk < g or blk % g:
            raise ValueError(f"block_size={blk!r} must be a positive multiple of the page size {g}")
        if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens < blk:
            raise ValueError(f"max_tokens={max_tokens!r} must be an int of at least one block ({blk} tokens)")
        if tail_chunk is None:
            tail_chunk = default_tail_chunk(blk)  # a warm hit's few new tokens cost a few, not a padded block
        if not isinstance(tail_chunk, (int, np.integer)) or isinstance(tail_chunk, bool) or not 1 <= tail_chunk <= blk:
            raise ValueError(f"tail_chunk={tail_chunk!r} must be an int in [1, block_size={blk}]")
        slots = int(max_tokens) // int(blk)
        dtype = dtype or model.dtypes.compute
        n = blk // g
        self.store = tuple(
            layer.self_attn.init_state(slots, dtype)
            if layer.layer_type == "linear"
            else layer.self_attn.init_state(slots * n, g, dtype, slots)
            for layer in model.layers
        )
        self.tokens = jnp.zeros((slots, blk), jnp.int32)
        self.parent = jnp.full((slots,), -1, jnp.int32)
        self.valid = jnp.zeros((slots,), bool)
        self.depth = jnp.zeros((slots,), jnp.int32)
        self.used = jnp.zeros((slots,), jnp.int32)
        self.clock = jnp.int32(1)
        self.counts = jnp.zeros((len(COUNTERS), 2), jnp.int32)
        self.mark = _weights_mark(model)
        self.block_size, self.tail_chunk, self.page_size = int(blk), int(tail_chunk), g
        self.model_key, self.lent = _model_key(model), False

    # ------------------------------------------------------------------ pytree
    _CHILDREN = ("store", "tokens", "parent", "valid", "depth", "used", "clock", "counts", "mark")
    _STATIC = ("block_size", "tail_chunk", "page_size", "model_key", "lent")

    def tree_flatten(self):
        return tuple(getattr(self, k) for k in self._CHILDREN), tuple(getattr(self, k) for k in self._STATIC)

    @classmethod
    def tree_unflatten(cls, aux, children):
        pc = object.__new__(cls)
        for k, v in zip(cls._CHILDREN, children, strict=True):
            setattr(pc, k, v)
        for k, v in zip(cls._STATIC, aux, strict=True):
            setattr(pc, k, v)
        return pc

    def _replace(self, **kw) -> PrefixCache:
        children, aux = self.tree_flatten()
        pc = PrefixCache.tree_unflatten(aux, children)
        for k, v in kw.items():
            setattr(pc, k, v)
        return pc

    # ------------------------------------------------------------------ facts
    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots * self.block_size

    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds (pools, snapshots and the block table); a lent cache holds no pools."""
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self) if hasattr(x, "nbytes"))

    def __repr__(self) -> str:
        stored = f"{int(np.asarray(self.valid).sum())}" if is_concrete(self.valid) else "?"
        lent = ", lent" if self.lent else ""
        return (
            f"PrefixCache({stored} of {self.num_slots} blocks of {self.block_size} tokens stored, "
            f"tail_chunk={self.tail_chunk}{lent})"
        )

    def default_chunk(self, model) -> int:
        """Tokens per prefill call when none are given: `default_prefill_chunk(model)` (what a prefill without
        the cache runs in one call) rounded down to whole blocks, at least one block."""
        return max(1, default_prefill_chunk(model) // self.block_size) * self.block_size

    def stats(self) -> dict[str, int]:
        """hit_tokens / miss_tokens: prompt tokens served from the cache / prefilled, over every call;
        evictions: stored blocks dropped to make room; cached_tokens: tokens stored now; capacity_tokens."""
        counts = np.asarray(self.counts).astype(np.int64)
        out = {k: int(hi) * (1 << LIMB) + int(lo) for k, (hi, lo) in zip(COUNTERS, counts, strict=True)}
        out["cached_tokens"] = int(np.asarray(self.valid).sum()) * self.block_size
        out["capacity_tokens"] = self.capacity_tokens
        return out

    def check(self, model) -> None:
        """ValueError unless this cache was built for `model` (config, dtype, quantization and, where concrete,
        its weights)."""
        key = _model_key(model)
        if key != self.model_key:
            (cfg, dt, quant), (own_cfg, own_dt, own_quant) = key, self.model_key
            diff = [
                f"{f.name}={getattr(cfg, f.name)!r} (cache: {getattr(own_cfg, f.name)!r})"
                for f in dataclasses.fields(cfg)
                if getattr(cfg, f.name) != getattr(own_cfg, f.name)
            ]
            diff += [f"dtype={dt} (cache: {own_dt})"] if dt != own_dt else []
            diff += [f"quant={quant} (cache: {own_quant})"] if quant != own_quant else []
            raise ValueError(f"prefix_cache was built for another model: {'; '.join(diff)}")
        mark = _weights_mark(model)
        if is_concrete(mark, self.mark) and int(mark) != int(self.mark):
            raise ValueError(
                f"prefix_cache was built for other weights of this config (weight mark {int(self.mark)} != {int(mark)})"
            )

    # ------------------------------------------------------------------ prefill
    def prefill(self, model, input_ids, lengths=None, *, max_len: int, rows=None, chunk: int | None = None):
        """Prefill prompts through the cache: ids [B, T] right-padded, lengths [B] (default T), max_len the
        capacity of each sequence (prompt + tokens to come). -> (float32 logits [B, vocab] at each row's last
        prompt token, the `HybridCache` to decode with, this PrefixCache updated and *lent*: pass that cache to
        `release` when decoding is done). rows [B] bool (default all): rows to serve; the others take no hit and
        store nothing. Under jit, weights other than the cache's make every row miss and store nothing.
        chunk: tokens per prefill call, a multiple of block_size (static; default `default_chunk(model)`): the
        new tokens go in calls of `chunk` that keep the states at every block end inside them, then in block
        calls, then in calls of tail_chunk (module docstring, step 3)."""
        if self.lent:
            raise ValueError("prefix_cache is lent to a running cache: call release(cache) first")
        self.check(model)
        if chunk is None and jax.process_count() > 1:
            raise ValueError(
                "PrefixCache.prefill: pass chunk= with several processes (free memory differs between hosts and "
                "the chunk shapes the compiled program)"
            )
        chunk = self.default_chunk(model) if chunk is None else chunk
        if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1 or chunk % self.block_size:
            raise ValueError(
                f"chunk={chunk!r} must be a positive multiple of the prefix cache's block_size={self.block_size} "
                "(its calls end on block boundaries; static under jit)"
            )
        ids = jnp.asarray(input_ids, jnp.int32)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, time] with time >= 1, got shape {ids.shape}")
        b, t = ids.shape
        blk, g, s = self.block_size, self.page_size, self.num_slots
        if not isinstance(max_len, (int, np.integer)) or not t <= max_len <= model.config.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len!r} must be an int in [{t}, max_position_embeddings="
                f"{model.config.max_position_embeddings}]"
            )
        nblk = -(-max_len // blk)
        if b * nblk > s:
            raise ValueError(
                f"prefix_cache holds {s} blocks of {blk} tokens (max_tokens {s * blk}): a batch of {b} rows of up to "
                f"max_len={max_len} tokens needs {b * nblk}"
            )
        lens = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        if is_concrete(lens) and ((np.asarray(lens) < 1).any() or (np.asarray(lens) > t).any()):
            raise ValueError(f"lengths {np.asarray(lens).tolist()} must lie in [1, {t}]")
        model._check_ids(ids, lens)
        ok = jnp.ones((b,), bool) if rows is None else jnp.asarray(rows, bool)
        ok = ok & (_weights_mark(model) == self.mark)

        matched, m = self._lookup(ids, lens, ok)
        slots, valid, parent, evicted = self._allocate(matched, m, nblk)
        used = self.used.at[jnp.where(matched >= 0, matched, s)].set(self.clock, mode="drop")

        # the cache: pools shared with the store (page table through the row's slots), states from snapshots
        n = blk // g
        pages = (slots[:, :, None] * n + jnp.arange(n, dtype=jnp.int32)).reshape(b, nblk * n)
        table = pages[:, : -(-max_len // g)]
        last = jnp.where(m > 0, jnp.take_along_axis(slots, jnp.maximum(m - 1, 0)[:, None], 1)[:, 0], s)
        layers = tuple(
            _with_per_seq(st, jax.tree.map(lambda x: jnp.take(x, last, 0, mode="fill", fill_value=0), _per_seq(st)))
            for st in self.store
        )
        cache = HybridCache(layers=layers, page_table=table, lengths=m * blk, max_len=max_len, page_size=g)

        logits, cache, snaps = self._prefill_blocks(model, ids, lens, m, slots, cache, chunk)
        tokens, parent, valid, depth, used = self._register(ids, lens, m, slots, ok, parent, valid, used)
        counts = _add(self.counts[0], jnp.sum(jnp.where(ok, m * blk, 0)))[None]
        counts = jnp.concatenate([counts, _add(self.counts[1], jnp.sum(jnp.where(ok, lens - m * blk, 0)))[None]])
        counts = jnp.concatenate([counts, _add(self.counts[2], evicted)[None]])
        lent = tuple(_with_per_seq(st, snap, pools_from=_NO_POOLS) for st, snap in zip(self.store, snaps, strict=True))
        pc = self._replace(
            store=lent, tokens=tokens, parent=parent, valid=valid, depth=depth, used=used,
            clock=self.clock + 1, counts=counts, lent=True,
        )  # fmt: skip
        return logits, cache, pc

    def release(self, cache: HybridCache) -> PrefixCache:
        """Take the page pools back from the cache `prefill` lent them to (after its last decode step or
        speculative commit). Stored blocks are as `prefill` left them: no sequence writes before its length."""
        if not self.lent:
            raise ValueError("release: this prefix_cache lends no pools (release the one prefill returned)")
        if cache.page_size != self.page_size or len(cache.layers) != len(self.store):
            raise ValueError("release: the cache was not made by this prefix_cache's prefill")
        store = []
        for st, ca in zip(self.store, cache.layers, strict=True):
            if isinstance(st, (MLAState, AttnState)):
                pool = ca.latent if isinstance(st, MLAState) else ca.k
                if pool.values.shape[0] != self.num_slots * (self.block_size // self.page_size):
                    raise ValueError("release: the cache's page pools are not this prefix_cache's")
                st = _with_per_seq(st, _per_seq(st), pools_from=ca)
            store.append(st)
        return self._replace(store=tuple(store), lent=False)

    # ------------------------------------------------------------------ steps
    def _lookup(self, ids, lens, ok):
        """-> (matched [B, nb] slot of each leading block that hits, -1 after the first miss; m [B] hits)."""
        b, t = ids.shape
        blk = self.block_size
        nb = t // blk
        if nb == 0:
            return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)
        blocks = jnp.moveaxis(ids[:, : nb * blk].reshape(b, nb, blk), 1, 0)  # [nb, B, blk]
        eligible = (lens - 1) // blk

        def step(carry, xs):
            prev, alive = carry
            i, block = xs
            eq = self.valid[None] & (self.parent[None] == prev[:, None])
            eq = eq & jnp.all(self.tokens[None] == block[:, None], axis=-1)  # [B, S]
            hit = alive & jnp.any(eq, axis=1) & (i < eligible)
            slot = jnp.where(hit, jnp.argmax(eq, axis=1).astype(jnp.int32), -1)
            return (slot, hit), slot

        init = (jnp.full((b,), -1, jnp.int32), ok)
        _, matched = jax.lax.scan(step, init, (jnp.arange(nb, dtype=jnp.int32), blocks))
        matched = matched.T
        return matched, jnp.sum(matched >= 0, axis=1).astype(jnp.int32)

    def _allocate(self, matched, m, nblk):
        """-> (slots [B, nblk] of each row: matched then fresh, the new valid / parent tables, evictions)."""
        b = m.shape[0]
        s = self.num_slots
        in_use = jnp.zeros((s,), bool).at[jnp.where(matched >= 0, matched, s)].set(True, mode="drop")
        # free slots first, then stored blocks by age (oldest first; deepest first among equals), matched never
        klass = jnp.where(in_use, 2, jnp.where(self.valid, 1, 0))
        order = jnp.lexsort((-self.depth, self.used, klass)).astype(jnp.int32)
        cand = order[: b * nblk]
        fresh = nblk - m
        offset = jnp.cumsum(fresh) - fresh
        i = jnp.arange(nblk, dtype=jnp.int32)[None, :]
        pick = jnp.clip(offset[:, None] + i - m[:, None], 0, b * nblk - 1)
        padded = jnp.pad(matched, [(0, 0), (0, nblk - matched.shape[1])], constant_values=-1)
        slots = jnp.where(i < m[:, None], padded, cand[pick])
        taken = jnp.zeros((s,), bool).at[cand].set(jnp.arange(b * nblk) < jnp.sum(fresh))
        evicted = jnp.sum(taken & self.valid)
        valid = self.valid & ~taken

        def orphans(v):  # stored blocks whose parent is no longer stored
            return v & (self.parent >= 0) & ~v[jnp.maximum(self.parent, 0)]

        def drop(carry):
            v, count = carry
            o = orphans(v)
            return v & ~o, count + jnp.sum(o)

        valid, evicted = jax.lax.while_loop(lambda c: jnp.any(orphans(c[0])), drop, (valid, evicted))
        parent = jnp.where(valid, self.parent, -1)
        return slots, valid, parent, evicted

    def _prefill_blocks(self, model, ids, lens, m, slots, cache, chunk: int):
        """Prefill each row's tokens from its first unmatched block on, in calls aligned to its blocks, the
        per-sequence states after each full block going to the block's slot:
          1. calls of `chunk` tokens (a multiple of the block size; the prompt's whole blocks where it has fewer)
             while a row has a whole call left, each returning the states at every block end inside it
             (`HybridLM.prefill(snapshot_every=block_size)`: KDA's from its state pass, nothing recomputed), so
             storing a long prompt costs about what one prefill of it costs; a row with fewer such calls than
             the longest takes all it has left in one more (the call runs for the others anyway);
          2. block calls for the whole blocks left (each stores the state it ends with);
          3. a short partial last block in calls of `tail_chunk` tokens (`prefill_in_two_sizes`: a few new
             tokens after a hit cost a few tokens, not a whole padded block).
        -> (logits at the last prompt token, cache, the store's per-sequence snapshots)."""
        blk, tc, s = self.block_size, self.tail_chunk, self.num_slots
        start0 = m * blk
        logits = jnp.zeros((ids.shape[0], model.config.vocab_size), jnp.float32)
        snaps = tuple(_per_seq(st) for st in self.store)

        def put(store, block, full, leaves):  # leaves [B, k, ...] of blocks [B, k] -> their slots where full
            dest = jnp.where(full, jnp.take_along_axis(slots, jnp.clip(block, 0, slots.shape[1] - 1), 1), s)
            flat = dest.reshape(-1)

            def one(st, x):
                return st.at[flat].set(x.reshape(-1, *x.shape[2:]).astype(st.dtype), mode="drop")

            return tuple(jax.tree.map(one, sn, le) for sn, le in zip(store, leaves, strict=True))

        # stage 1's call size: `chunk`, or the prompt's whole blocks where it has fewer (static)
        size = min(chunk, ids.shape[1] // blk * blk)
        per = size // blk
        full = jnp.zeros_like(m)  # calls of `size` whose every token is a row's
        done = jnp.zeros(m.shape, bool)  # rows whose last call holds all they had left
        if per > 1:
            full = (lens - start0) // size
            # a row with fewer whole calls than the longest takes its rest (< size tokens) in a call that runs anyway
            take = jnp.where(full < jnp.max(full), full + 1, full)
            done = take > full

            def store_chunk(c, n_new, cache, store, taken):  # call c: blocks m + c·per + j, j < per
                j = jnp.arange(per, dtype=jnp.int32)[None, :]
                whole = n_new[:, None] >= (j + 1) * blk
                taken = tuple((x.conv, x.recurrent) if isinstance(x, KDAState) else x for x in taken)  # as _per_seq
                return put(store, m[:, None] + c * per + j, whole, taken)

            logits, cache, snaps = prefill_calls(
                model, ids, lens, cache, logits, start0, size, take=take, after=store_chunk, carry=snaps,
                snapshot_every=blk,
            )  # fmt: skip
        first = m + full * per  # each row's first block after stage 1

        def store_block(c, n_new, cache, store):  # after block call c: a full block first + c -> its slot
            leaves = tuple(jax.tree.map(lambda x: x[:, None], _per_seq(la)) for la in cache.layers)
            return put(store, (first + c)[:, None], (n_new == blk)[:, None], leaves)

        start = jnp.where(done, lens, first * blk)
        return prefill_in_two_sizes(model, ids, lens, cache, logits, start, blk, tc, after=store_block, carry=snaps)

    def _register(self, ids, lens, m, slots, ok, parent, valid, used):
        """Store every full prompt block past the matched ones, row by row (a block already stored — by an
        earlier row of this call — is chained to, not stored again)."""
        b, t = ids.shape
        blk, s = self.block_size, self.num_slots
        nb = t // blk
        tables = (self.tokens, parent, valid, self.depth, used)
        if nb == 0:
            return tables
        full = jnp.where(ok, lens // blk, 0)
        blocks = ids[:, : nb * blk].reshape(b, nb, blk)

        def row(tables, r):
            def block(carry, i):
                (tokens, parent, valid, depth, used), prev = carry
                tok = blocks[r, i]
                eq = valid & (parent == prev) & jnp.all(tokens == tok[None], axis=-1)
                exists = jnp.any(eq)
                mine = slots[r, i]
                active = (i >= m[r]) & (i < full[r])
                dest = jnp.where(active & ~exists, mine, s)
                tokens = tokens.at[dest].set(tok, mode="drop")
                parent = parent.at[dest].set(prev, mode="drop")
                valid = valid.at[dest].set(True, mode="drop")
                depth = depth.at[dest].set(i, mode="drop")
                used = used.at[dest].set(self.clock, mode="drop")
                here = jnp.where(exists, jnp.argmax(eq).astype(jnp.int32), mine)
                prev = jnp.where(i < m[r], mine, jnp.where(active, here, prev))
                return ((tokens, parent, valid, depth, used), prev), None

            (tables, _), _ = jax.lax.scan(block, (tables, jnp.int32(-1)), jnp.arange(nb, dtype=jnp.int32))
            return tables, None

        tables, _ = jax.lax.scan(row, tables, jnp.arange(b, dtype=jnp.int32))
        return tables


@dataclasses.dataclass(frozen=True)
class _NoPools:
    """Stands in for the pools of a lent PrefixCache's attention layers."""

    latent: None = None
    rope: None = None
    index_k: None = None
    k: None = None
    v: None = None


_NO_POOLS = _NoPools()
