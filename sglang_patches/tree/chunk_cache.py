"""A radix cache whose passage chunks are found by content, not by what precedes them.

It is SGLang's own `RadixCache`, with two namespaces added through `extra_key`:

* ``picrag:chunk`` holds every compiled chunk's KV, computed alone at positions 0..n-1 and
  keyed by the chunk's token ids behind a digest of the whole chunk
  (sglang_patches.plan.keys.store_key: two chunks never share nodes, so a stored chunk's KV is
  its own compile's). One server serves one model, so the model is implicit in the tree; the
  persistent tier adds the model fingerprint.
* ``picrag:<policy>:...`` holds linked prompts. When a request of a chunk-reusing policy arrives,
  the chunks that directly follow its longest matched prefix are *grafted*: fresh pool slots
  receive each stored chunk's keys rotated to the chunk's offset (values copied), and that
  run of slots is inserted into the tree under the request's own token path. The ordinary
  prefix match that follows then finds the chunks as cached prefix, so SGLang's scheduler,
  allocator, locking, eviction and release work unchanged. The stored chunk is never
  modified; grafted slots belong to the tree and are evicted LRU like any other node; an
  evicted chunk simply is not grafted, and its tokens are computed as ordinary extend tokens.
  Each linked request carries one plan, built when it arrives (sglang_patches.plan.link_plan), and a
  linked prompt is keyed by everything its cached KV depends on (sglang_patches.plan.keys): two
  requests share a cached slot only where their policy computes the same value for it. A
  request with chunk tokens it could not graft (a chunk missing from the store, a graft cut
  short by `logprob_start_len` or the last prompt token) computes them in context and is not
  inserted; a cut chunk is reported as such (`picrag_chunks_cut`), so the frontend does not
  link it again for nothing.

Eviction keeps the chunk store last (`ChunksLast`): every other node (linked prompts, which only
an exact repeat in the same order could reuse, and vanilla prefixes) is evicted before any
stored chunk, in the configured order (LRU by default) within each group.

Leases: a linked request's stored chunks are locked from its arrival at the scheduler
(`lease_chunks`, called by sglang_patches.tree.link_admission) until its graft is done (its first
forward, sglang_patches.steps.batch_annotations) or it is aborted, so no other request's allocation
can evict them between arrival and graft; a link that asked to be refused when a chunk is
missing is answered before any compute. Leases never pin more than LEASE_POOL_SHARE of the pool
(a chunk leased by several requests counts once), and one older than LEASE_TIMEOUT_S lapses, so
pinned chunks can never starve the pool.

A client never names these namespaces: its own `extra_key` is moved out of them, and a picrag
hint the engine does not admit is refused as the request arrives (`admit`, called by
sglang_patches.tree.link_admission; the rules: sglang_patches.guard.request_guard).

What a request gets follows its policy family's flags (picrag_core.policies). Vanilla
requests (no picrag hint) and families that reuse no chunks (``prefix``) use the plain tree;
``full`` matches nothing and stores nothing. Families that repair (``cacherepair``,
``cacherepair+legolink``) graft and then correct the grafted KV with the repair network
(sglang_patches.steps.kv_repair). Families with a reordered layout (``legolink``,
``cacherepair+legolink``) graft the head and the chunks' rests; the first k tokens of every chunk
are extend tokens. Families that blend (``cacheblend``) graft only the head: their chunks are
extend tokens whose cached KV is placed in the forward (sglang_patches.steps.cacheblend).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_patches.steps.cacheblend import blend_plan
from sglang_patches.store.codec import CorruptChunkFile
from sglang_patches.store.protocol import ChunkStore
from picrag_core.link_hints import MISS_REFUSAL, LinkHintError
from picrag_core.chunk_key import StoredChunk
from sglang_patches.plan.link_plan import PLAN_ATTR, LinkPlan, build_plan, plan_of
from sglang_patches.plan.link_state import STATE_ATTR, LinkStats, state_of
from sglang_patches.steps.kv_repair import RepairPart, RepairSpan, repair_spans
from picrag_core.repair.network import ChunkInputs
from picrag_core.request_bounds import NAMESPACE_PREFIX, client_namespace
from sglang_patches.guard.request_guard import EngineSettings, admitted_link, shape_of_req
from sglang_patches.store.calls import StoreUnavailable
from picrag_core.rope_shift import KeyShifter
from sglang_patches.plan.keys import store_key

logger = logging.getLogger(__name__)

CHUNK_NAMESPACE = f"{NAMESPACE_PREFIX}chunk"
LEASE_POOL_SHARE = 0.5  # leases never lock more of the KV pool than this
LEASE_TIMEOUT_S = 600.0  # a lease whose request neither ran nor was aborted by then lapses


def _with_namespace(namespace: str, extra_key: Optional[str]) -> str:
    return namespace if extra_key is None else f"{namespace}|{extra_key}"


@dataclass
class _Graft:
    source_slots: torch.Tensor
    shift: int
    repair: Optional[RepairPart] = None  # repairing families: the run of its chunk this graft writes


class ChunksLast(EvictionStrategy):
    """`base`'s eviction order, with the chunk store's nodes after all others: a stored chunk
    serves any prompt that holds its passage, a cached linked prompt only the same prompt."""

    def __init__(self, base: EvictionStrategy):
        self.base = base

    def get_priority(self, node: TreeNode):
        return (getattr(node.key, "extra_key", None) == CHUNK_NAMESPACE, self.base.get_priority(node))


@dataclass
class _Lease:
    locks: list
    chunks: list[str]  # digests of the stored chunks it holds (a chunk linked twice, twice)
    deadline: float


@dataclass
class CacheCounters:
    """Process-wide totals; exported to Prometheus by sglang_patches.tree.metrics."""

    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, amount: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + amount


class ChunkRadixCache(RadixCache):
    def __init__(
        self,
        params,
        kv_pool,
        shifter: KeyShifter,
        engine: EngineSettings,
        counters: Optional[CacheCounters] = None,
        disk_store: Optional[ChunkStore] = None,
        repairer=None,
    ):
        if params.page_size != 1:
            raise ValueError(f"picrag's chunk cache needs page_size 1, got {params.page_size}")
        super().__init__(params)
        self.eviction_strategy = ChunksLast(self.eviction_strategy)
        self.kv_pool = kv_pool
        self.shifter = shifter
        self.engine = engine  # what link admission checks against (the model's BOS, the attention backend)
        self.counters = counters or CacheCounters()
        self.disk_store = disk_store
        self.repairer = repairer  # repair.network.KVRepairer for the repairing families, or None

    def reset(self):
        # Flushing the tree drops every node a lease locks; only an idle server flushes.
        self._leases: dict[str, _Lease] = {}
        self._leased: Counter[str] = Counter()  # stored chunk digest -> leases holding it
        self._leased_tokens: dict[str, int] = {}  # stored chunk digest -> its tokens, while leased
        # A stored chunk's repair-network inputs (kv_repair.chunk_inputs), computed from its KV once
        # and kept while its node lives: a node's KV never changes, and it goes when the node does.
        self._repair_inputs: weakref.WeakKeyDictionary[TreeNode, ChunkInputs] = weakref.WeakKeyDictionary()
        super().reset()
        # A flush empties the host tier too (RadixCache.__init__ resets before disk_store is set).
        if getattr(self, "disk_store", None) is not None:
            self.disk_store.clear()

    # ---- request routing -------------------------------------------------------------

    def admit(self, req) -> Optional[str]:
        """Admit a request as the scheduler queues it, once (sglang_patches.tree.link_admission):
        its plan and state are built and its stored chunks leased. Returns why it must be refused
        with a 400 (a picrag hint the engine does not serve), or None."""
        try:
            self._plan_of(req, refuse=True)
        except LinkHintError as exc:
            self.counters.add("link_hint_refusals")
            return f"kv_hints: {exc}"
        return None

    def _plan_of(self, req, refuse: bool = False) -> Optional[LinkPlan]:
        """The request's link plan, built the first time the cache sees it (None: vanilla), with
        its state. `refuse`: a hint the engine does not admit raises LinkHintError (at the
        scheduler's intake, where the request is then refused); elsewhere, which only a request
        that never passed the intake reaches, it is served as a vanilla one, never as asked."""
        if req is None:
            return None
        if hasattr(req, PLAN_ATTR):
            return plan_of(req)
        shape = shape_of_req(req)
        # Runs before the request's first match or insert: from here on, a client's own
        # extra_key can never name one of picrag's namespaces.
        req.extra_key = client_namespace(req.extra_key)
        if req.kv_hints is not None:
            self.counters.add("admissions")
        try:
            link = admitted_link(req.kv_hints, shape, self.engine)
        except LinkHintError as exc:
            if refuse:
                raise
            logger.warning("request %s: ignoring picrag hint: %s", req.rid, exc)
            link = None
        if link is not None and link.family.repairs and self.repairer is None:
            # The frontend refuses repairing families without a checkpoint; a raw /generate gets
            # the family's unrepaired counterpart.
            logger.warning("request %s: %s without a repair checkpoint, serving it as %s",
                           req.rid, link.policy, link.family.unrepaired)
            link = dataclasses.replace(link, policy=link.family.unrepaired)
        plan = state = None
        if link is not None:
            digest = None if self.repairer is None else self.repairer.checkpoint_digest
            plan, state = build_plan(list(req.origin_input_ids), link, digest)
            state.count = self._count
            if not link.family.inserts_into_tree:
                # full stores nothing. A blended token's KV depends on the whole prompt (the
                # deviation ranking), so it is no prefix to share; cacheblend's namespace only
                # holds grafted heads.
                req.skip_radix_cache_insert = True
            if link.compile:
                req.extra_key = CHUNK_NAMESPACE  # admitted compiles carry no namespace of the client's
            elif plan.namespace is not None:
                req.extra_key = _with_namespace(plan.namespace, req.extra_key)
        setattr(req, PLAN_ATTR, plan)
        setattr(req, STATE_ATTR, state)
        return plan

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        plan = self._plan_of(req)
        key = params.key
        if req is not None and (key.extra_key != req.extra_key or (plan is not None and plan.tree_key is not None)):
            # SGLang built the key from the plain tokens, before _plan_of namespaced the request.
            key = RadixKey(self._tree_tokens(req, key.token_ids), req.extra_key, is_bigram=key.is_bigram,
                           limit=key.limit, cache_salt=key.cache_salt)
        if plan is None:
            return super().match_prefix(dataclasses.replace(params, key=key))
        state = state_of(req)
        link, stats = plan.link, state.stats
        # Positions a link reports on are computed by it, none of them matched from the tree: the
        # question's attention (measured as the question is computed) and the distributions after
        # the last positions (a repeat of the same forced answer would otherwise match them).
        report = stats.context_attention
        limits = [limit for limit in (None if report is None else report.question_start,
                                      None if stats.span is None else stats.span.first_position) if limit is not None]
        if limits and len(key) > min(limits):
            key = RadixKey(key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=min(limits),
                           cache_salt=key.cache_salt)
        if not link.family.matches_tree:
            result = self._empty_match_result
        else:
            if link.compile and self.disk_store is not None and not self.disable:
                found = self.lookup_chunk(plan.compiled)
                if found is not None:
                    self.unlock(found[2])
            if plan.segments and not self.disable:
                self._graft_chunks(key, plan, stats)
                if stats.chunk_misses:
                    # Chunks it could not graft are computed as ordinary tokens, in context:
                    # that KV is not this policy's and must not serve a later request as if it
                    # were (sglang_patches.plan.keys).
                    req.skip_radix_cache_insert = True
            result = super().match_prefix(dataclasses.replace(params, key=key))
            if link.family.blends_chunks and not self.disable:
                state.blend = blend_plan(self, plan, result.device_prefix_len, stats)
        prompt_len = len(req.origin_input_ids)
        stats.reused_tokens = result.device_prefix_len
        stats.computed_tokens = prompt_len - result.device_prefix_len
        if link.compile:
            # SGLang always computes the last prompt token, so a cached chunk matches n - 1.
            stats.chunk_hits = int(result.device_prefix_len >= prompt_len - 1)
            stats.chunk_misses = 1 - stats.chunk_hits
        return result

    @staticmethod
    def _tree_tokens(req, token_ids):
        """The tree key's tokens for `token_ids` (a prefix of the request's prompt and output)."""
        plan = plan_of(req)
        if plan is None or plan.tree_key is None:
            return token_ids
        return plan.tree_key[: len(token_ids)] + array("q", token_ids[len(plan.tree_key):])

    def _insert_cache(self, req, token_ids, **kwargs):
        # SGLang's one place that keys what a request computed (its release and checkpoints).
        return super()._insert_cache(req, self._tree_tokens(req, token_ids), **kwargs)

    # ---- leases ----------------------------------------------------------------------

    def lease_chunks(self, req) -> Optional[str]:
        """Lock the stored chunks `req` links until its graft is done (see the module docstring).
        Returns why the request must be refused now (MISS_REFUSAL: a chunk is not stored and the
        link asked to be refused then), or None to queue it."""
        plan = self._plan_of(req)
        if plan is None or not plan.stored_chunks or self.disable:
            return None
        self._expire_leases()
        locks, digests, missing = [], [], 0
        new_tokens: dict[str, int] = {}  # chunks no lease holds yet: what this one adds to the pinned share
        for chunk in plan.stored_chunks:
            found = self.lookup_chunk(chunk)
            if found is None:
                missing += 1
                continue
            locks.append(found[2])
            digests.append(chunk.digest)
            if chunk.digest not in self._leased:
                new_tokens[chunk.digest] = len(chunk)
        if (missing and plan.link.refuse_on_miss) or self.leased_tokens + sum(new_tokens.values()) > LEASE_POOL_SHARE * self.kv_pool.size:
            for lock in locks:
                self.unlock(lock)
            if missing and plan.link.refuse_on_miss:
                self.counters.add("link_refusals")
                return f"{MISS_REFUSAL}: {missing} of {len(plan.stored_chunks)} chunk(s) missing"
            self.counters.add("leases_over_share")
            return None
        self._release_lease(req.rid)
        self._leases[req.rid] = _Lease(locks, digests, time.monotonic() + LEASE_TIMEOUT_S)
        self._leased.update(digests)
        self._leased_tokens.update(new_tokens)
        rid = req.rid
        state_of(req).end_lease = lambda: self._release_lease(rid)
        return None

    def _release_lease(self, rid: str) -> None:
        lease = self._leases.pop(rid, None)
        if lease is None:
            return
        for lock in lease.locks:
            self.unlock(lock)
        self._leased.subtract(lease.chunks)
        for digest in lease.chunks:
            if self._leased[digest] <= 0:
                del self._leased[digest]
                self._leased_tokens.pop(digest, None)

    @property
    def leased_tokens(self) -> int:
        """Tokens of the pool the leases pin: each leased chunk once, however many leases hold it."""
        return sum(self._leased_tokens.values())

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, lease in self._leases.items() if lease.deadline < now]:
            logger.warning("request %s: chunk lease lapsed after %.0f s", rid, LEASE_TIMEOUT_S)
            self.counters.add("leases_lapsed")
            self._release_lease(rid)

    def release_aborted_request(self, handle) -> None:
        # SGLang's release of a request aborted while it waited (it never reaches on_release).
        super().release_aborted_request(handle)
        self._release_lease(handle.rid)

    # ---- grafting --------------------------------------------------------------------

    def _find_chunk(self, chunk: StoredChunk) -> Optional[tuple[TreeNode, torch.Tensor]]:
        key = RadixKey(store_key(chunk), CHUNK_NAMESPACE)
        values, node = self._match_prefix_helper(self.root_node, key)
        if sum(len(v) for v in values) != len(key):
            return None
        return node, torch.cat(values)

    @contextmanager
    def held_chunks(self, chunks: Sequence[StoredChunk]) -> Iterator[list[Optional[torch.Tensor]]]:
        """Each stored chunk's pool slots (None: not in the pool), held against eviction until
        the block ends. Nothing is reloaded or counted: the view CacheBlend reads its cached KV
        through, once per extend."""
        found = [self._find_chunk(chunk) for chunk in chunks]
        locks = [self.lock(node) for node, _ in filter(None, found)]
        try:
            yield [None if entry is None else entry[1] for entry in found]
        finally:
            for lock in locks:
                self.unlock(lock)

    def lookup_chunk(self, chunk: StoredChunk):
        """(node, slots, lock) of a compiled chunk, reloaded from disk if needed; None if absent.

        The node comes back locked so that later allocations (another reload, a graft) cannot
        evict it before its KV is used; the caller unlocks."""
        found = self._find_chunk(chunk)
        if found is None and self.disk_store is not None:
            found = self._load_from_disk(chunk)
        if found is None:
            return None
        node, slots = found
        return node, slots, self.lock(node)

    def _allocate(self, needed: int) -> Optional[torch.Tensor]:
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < needed:
            self.evict(EvictParams(num_tokens=needed - allocator.available_size()))
        slots = allocator.alloc(needed)
        return None if slots is None else slots.to(torch.int64)

    @torch.no_grad()
    def _load_from_disk(self, chunk: StoredChunk) -> Optional[tuple[TreeNode, torch.Tensor]]:
        pool = self.kv_pool
        try:
            # Checked against the pool's layers, KV heads, head dims and dtypes: a file of
            # another shape is rejected, never copied into the pool.
            loaded = self.disk_store.load(chunk, pool)
        except CorruptChunkFile as exc:
            logger.warning("ignoring persisted chunk: %s", exc)
            self.counters.add("disk_rejects")
            return None
        except StoreUnavailable as exc:
            # A store that is down or slow costs the chunk's compute, never the request.
            logger.warning("chunk store unavailable: %s", exc)
            self.counters.add("store_failures")
            return None
        if loaded is None:
            self.counters.add("disk_misses")
            return None
        keys, values = loaded
        slots = self._allocate(len(chunk))
        if slots is None:
            return None
        for index, layer_id in enumerate(range(pool.start_layer, pool.start_layer + pool.layer_num)):
            pool.get_key_buffer(layer_id)[slots] = keys[index].to(pool.get_key_buffer(layer_id).device)
            pool.get_value_buffer(layer_id)[slots] = values[index].to(pool.get_value_buffer(layer_id).device)
        key = RadixKey(store_key(chunk), CHUNK_NAMESPACE)
        inserted = self.insert(InsertParams(key=key, value=slots))
        # A prefix shared with another cached chunk was already in the tree: its copy is spare.
        self.token_to_kv_pool_allocator.free(slots[: inserted.prefix_len])
        self.counters.add("disk_loads")
        return self._find_chunk(chunk)

    @torch.no_grad()
    def _save_to_disk(self, chunk: StoredChunk) -> None:
        """Hand a copy of the chunk's KV to the store's background writer. Runs on the
        scheduler's thread, so it never waits on the disk and never raises: a save it cannot
        queue is logged and counted as dropped (the chunk stays cached in memory)."""
        found = self._find_chunk(chunk)
        if found is None:
            return
        _, slots = found
        pool = self.kv_pool
        layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
        try:
            keys = torch.stack([pool.get_key_buffer(layer)[slots] for layer in layers])
            values = torch.stack([pool.get_value_buffer(layer)[slots] for layer in layers])
            self.disk_store.save_in_background(chunk, keys, values, self.counters)
        except Exception as exc:
            logger.warning("could not queue chunk save: %s: %s", type(exc).__name__, exc)
            self.counters.add("disk_saves_dropped")

    def _graft_chunks(self, key: RadixKey, plan: LinkPlan, stats: LinkStats) -> None:
        """Graft the plan's segments that follow the prompt's path in the tree, and count its
        chunks: hits (every run of it on the path or grafted), misses (not) and, of the misses,
        those cut by the request's own shape."""
        limit = len(key)  # SGLang caps the match (the last prompt token, logprob_start_len)
        # SGLang's helper cannot look up an empty key (logprob_start_len 0): nothing matches.
        values, prefix_node = self._match_prefix_helper(self.root_node, key) if limit else ([], self.root_node)
        matched = sum(len(v) for v in values)
        # Per chunk with something to graft: its runs not on the path, and those not grafted either.
        unmatched = Counter(seg.chunk for seg in plan.segments if seg.is_chunk and not seg.recomputed_whole)
        ungrafted = Counter(unmatched)
        grafts: list[_Graft] = []
        # Repairing families: every chunk the network sees, once, in prompt order. Chunks already
        # on the path and chunks recomputed whole are context only (nothing of theirs is written).
        network_spans: dict[int, RepairSpan] = {}
        network_nodes: dict[int, TreeNode] = {}  # their stored chunks' nodes, which keep the network's inputs
        stored: dict[int, torch.Tensor] = {}  # segment's chunk -> the stored slots, locked
        locks = [self.lock(prefix_node)]
        position = matched
        cut = False  # grafting stopped where the request's own shape stops it, not the store
        new_slots = None
        try:
            for seg in plan.segments:
                on_path = seg.end <= matched or seg.recomputed_whole  # nothing of it to graft
                if not on_path and (seg.start > position or position >= limit):
                    # Tokens before this segment are computed (a gap between chunks), or SGLang
                    # computes from here on: nothing after can be grafted, whatever is stored.
                    cut = True
                    break
                if (not on_path or plan.repairs and seg.is_chunk) and seg.chunk not in stored:
                    found = self.lookup_chunk(seg.stored)
                    if found is None:
                        # Not stored: it is computed, and so is what follows (the repair network
                        # could not see it, so what follows cannot get the KV the policy defines).
                        break
                    locks.append(found[2])
                    stored[seg.chunk] = found[1]
                    if plan.repairs and seg.is_chunk:
                        network_nodes[seg.chunk] = found[0]
                        network_spans[seg.chunk] = RepairSpan(found[1], list(seg.stored.tokens), seg.shift,
                                                              inputs=self._repair_inputs.get(found[0]))
                if on_path:
                    if seg.is_chunk and not seg.recomputed_whole:
                        unmatched[seg.chunk] -= 1
                        ungrafted[seg.chunk] -= 1
                    continue
                take_end = min(seg.end, limit)
                first = seg.chunk_offset + position - seg.start
                part = None
                if seg.chunk in network_spans:
                    part = RepairPart(first, take_end - position)
                    network_spans[seg.chunk].parts.append(part)
                grafts.append(_Graft(stored[seg.chunk][first : first + take_end - position], seg.shift, part))
                position = take_end
                if take_end < seg.end:
                    cut = True  # the rest of this segment is computed in context
                    break
                if seg.is_chunk:
                    ungrafted[seg.chunk] -= 1
            new_slots = self._materialize(grafts) if grafts else None
            if network_spans and new_slots is not None:
                self._repair(network_spans, network_nodes, grafts, new_slots)
        finally:
            for lock in locks:
                self.unlock(lock)
        if grafts and new_slots is None:
            ungrafted, cut = unmatched, False  # the pool is full: only what was on the path counts
        stats.chunk_hits = sum(1 for remaining in ungrafted.values() if remaining == 0)
        stats.chunk_misses = len(ungrafted) - stats.chunk_hits
        stats.chunks_cut = stats.chunk_misses if cut else 0
        if new_slots is None:
            return
        path_slots = torch.cat(values) if values else self._empty_device_indices
        inserted = self.insert(
            InsertParams(key=key[:position], value=torch.cat((path_slots, new_slots)))
        )
        assert inserted.prefix_len == matched, (inserted.prefix_len, matched)
        stats.grafted_tokens = len(new_slots)
        self.counters.add("grafted_tokens", len(new_slots))

    def _repair(self, spans: dict[int, RepairSpan], nodes: dict[int, TreeNode], grafts: list[_Graft],
                new_slots: torch.Tensor) -> None:
        offset = 0
        for graft in grafts:
            if graft.repair is not None:
                graft.repair.new_slots = new_slots[offset : offset + len(graft.source_slots)]
            offset += len(graft.source_slots)
        kept = sum(span.inputs is not None for span in spans.values())
        repaired = repair_spans(self.repairer, self.kv_pool, self.shifter, list(spans.values()))
        if repaired:
            for chunk, span in spans.items():
                self._repair_inputs[nodes[chunk]] = span.inputs
            self.counters.add("repair_inputs_kept", kept)
            self.counters.add("repair_inputs_computed", len(spans) - kept)
        self.counters.add("repaired_tokens", repaired)

    def _materialize(self, grafts: list[_Graft]) -> Optional[torch.Tensor]:
        """Fresh slots holding the grafts' KV shifted to their offsets; None if the pool is full.
        The caller holds locks on the grafts' sources and the prompt's matched prefix."""
        needed = sum(len(g.source_slots) for g in grafts)
        new_slots = self._allocate(needed)
        if new_slots is None:
            allocator = self.token_to_kv_pool_allocator
            logger.warning(
                "chunk graft of %d tokens skipped: KV pool full (free %d, evictable %d, locked %d)",
                needed, allocator.available_size(), self.evictable_size(), self.protected_size(),
            )
            self.counters.add("graft_skipped_pool_full")
            return None
        src = torch.cat([g.source_slots for g in grafts]).to(torch.int64)
        deltas = torch.cat([torch.full((len(g.source_slots),), g.shift, dtype=torch.int64) for g in grafts])
        self.copy_shifted(src, new_slots, deltas)
        return new_slots

    @torch.no_grad()
    def copy_shifted(self, src: torch.Tensor, dst: torch.Tensor, deltas: torch.Tensor, first_layer: int = 0) -> None:
        """Pool slots `dst` get the KV of `src` with each key moved by its delta, in the layers
        from `first_layer` (relative to the pool's start) on."""
        pool = self.kv_pool
        rotation = self.shifter.rotation(deltas, pool.get_key_buffer(pool.start_layer))
        for layer_id in range(pool.start_layer + first_layer, pool.start_layer + pool.layer_num):
            k_buffer = pool.get_key_buffer(layer_id)
            v_buffer = pool.get_value_buffer(layer_id)
            v_buffer[dst] = v_buffer.index_select(0, src)
            k_buffer[dst] = self.shifter.rotate(k_buffer.index_select(0, src), rotation)

    # ---- accounting ------------------------------------------------------------------

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._release_lease(req.rid)
        plan, state = plan_of(req), state_of(req)
        if plan is None:
            return
        stats = state.stats
        if plan.compiled is not None and stats.chunk_misses and checkpointed and self.disk_store is not None:
            self._save_to_disk(plan.compiled)
        state.answered()  # counted here if no output was built for it (an abort)

    def _count(self, stats: LinkStats) -> None:
        prefix = "compile_" if stats.policy == "compile" else ""
        self.counters.add(f"{prefix}requests")
        self.counters.add(f"{prefix}chunk_hits", stats.chunk_hits)
        self.counters.add(f"{prefix}chunk_misses", stats.chunk_misses)
        self.counters.add(f"{prefix}reused_tokens", stats.reused_tokens)
        self.counters.add(f"{prefix}computed_tokens", stats.computed_tokens)
