# Over 500 lines: vLLM's scheduler, one pass per step, kept whole to read beside vLLM's scheduler.py and for speed.
"""vLLM 0.33's V1 scheduler and its KV block pool, for the engine twin.

`Scheduler.step()` schedules one engine step as vLLM does (vllm/v1/core/sched/scheduler.py): running
requests first, then waiting ones, preempting the last running request when blocks run out. It holds no
time: the engine prices each step. How it follows vLLM: docs/architecture.md, "The twin's scheduler and KV
block pool".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import count

WAITING, RUNNING, FINISHED = 0, 1, 2


class Request:
    """A request as the scheduler sees it: token counts, no content."""

    __slots__ = (
        "request_id", "prompt_tokens", "max_tokens", "arrival_time", "num_computed", "num_tokens",
        "num_output", "num_blocks", "status", "prefix_key", "prefix_blocks", "shared", "register_ok",
        "num_preemptions", "sched", "finish_reason", "step_scheduled", "step_first_token",
        "step_last_token", "user", "own_key", "step_chained", "held",
    )

    def __init__(self, request_id: str, prompt_tokens: int, max_tokens: int, arrival_time: float,
                 prefix_key: str | None = None, prefix_blocks: int = 0) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.num_computed = 0  # tokens whose KV is in the cache
        self.num_tokens = prompt_tokens  # prompt + sampled tokens so far
        self.num_output = 0
        self.num_blocks = 0  # blocks held, shared prefix blocks included
        self.status = WAITING
        self.prefix_key = prefix_key
        self.prefix_blocks = prefix_blocks  # full blocks of the shareable prefix
        self.shared = 0  # leading blocks held through the prefix cache
        self.register_ok = True
        self.num_preemptions = 0
        self.sched = 0  # tokens scheduled in the current step
        self.finish_reason: str | None = None
        # Engine step indices (not times: the driver owns the clock): first scheduled, first and
        # latest token.  -1 = not yet.
        self.step_scheduled = -1
        self.step_first_token = -1
        self.step_last_token = -1
        self.step_chained = -1  # latest step that decoded the token sampled the step before
        # Shared blocks it holds through a second copy of a cached block (block index -> key).
        self.held: dict[int, tuple] | None = None
        self.user: object = None  # free slot for the driver (offline runner bookkeeping)
        self.own_key = ""  # cache key of its own blocks, unique per scheduler (set by Scheduler.add)


@dataclass(slots=True)
class StepOutcome:
    """What one scheduled step did (`Scheduler.step`), and what it lasted once the engine priced it.

    `req.sched` holds the tokens scheduled for each request in `scheduled`, negated when the request
    sampled a token this step.  Token times are step indices on the request (the scheduler has no
    clock): `num_steady` counts tokens whose previous token came at the end of the step before,
    `gaps` lists (previous step, this step) for the other non-first tokens.
    """

    scheduled: list[Request]
    finished: list[Request]  # reached max_tokens this step (released now, or after the next schedule if async)
    total_num_scheduled_tokens: int
    num_preemptions: int
    prefill_pairs: float  # sum over prefill chunks of (query token, key token) pairs: attention work
    decode_kv_tokens: int  # KV tokens the decodes read
    num_sampled: int  # requests that sampled a token
    num_steady: int
    gaps: list[tuple[int, int]]
    duration_s: float = 0.0  # set by Engine.run_step


def _sample(req: Request, k: int, finished: list[Request], gaps: list[tuple[int, int]]) -> int:
    """A request whose tokens are all computed samples one token at the end of step k.

    Records the token's step (first token, or a gap since the previous one in `gaps`), and
    queues the request in `finished` when it reached max_tokens.  Returns 1 when the previous
    token came at the end of step k-1 (a "steady" gap, counted rather than listed).  The decode
    fast path in `Scheduler.step` inlines the same logic: it runs for every token.
    """
    out = req.num_output + 1
    req.num_output = out
    req.num_tokens += 1
    last = req.step_last_token
    req.step_last_token = k
    if out >= req.max_tokens:
        finished.append(req)
    if last < 0:
        req.step_first_token = k
        return 0
    if last == k - 1:
        return 1
    gaps.append((last, k))
    return 0


class Scheduler:
    def __init__(self, *, num_gpu_blocks: int, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 long_prefill_token_threshold: int = 0, long_prefill_token_threshold_adaptive: bool = False,
                 enable_prefix_caching: bool = True,
                 reserve_full_isl: bool = True, watermark: float = 0.0, prefill_schedule_interval: int = 1,
                 async_scheduling: bool = False) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.long_prefill_token_threshold_adaptive = long_prefill_token_threshold_adaptive
        self.enable_prefix_caching = enable_prefix_caching
        self.reserve_full_isl = reserve_full_isl
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.prefill_schedule_interval = max(1, prefill_schedule_interval)
        self.async_scheduling = async_scheduling
        # Async scheduling: requests whose last token came out of the previous step; vLLM learns
        # it only after scheduling the next step, so they hold their slot and blocks until then.
        self._finishing: list[Request] = []
        # --prefill-schedule-interval (vLLM's DP engine core): steps since the engine last went
        # idle (a "wave"), and whether the last unthrottled step left waiting requests behind.
        self._wave_step = 0
        self._prefill_capacity_bound = False
        self._k = 0  # the step being scheduled
        self.usable_blocks = max(0, num_gpu_blocks - 1)  # one null block
        # vLLM's free block queue, least recently freed first.  A key is either a cached block,
        # (prefix key, block index), standing for one block, or an int naming a run of blocks
        # whose content nobody can hit; the value is how many blocks the entry stands for.
        self.queue: OrderedDict[tuple | int, int] = OrderedDict()
        self._run_ids = count()
        # Requests ever added: each one's own-block key, and the engine charges their intake to its next step.
        self.num_added = 0
        self.num_free = 0  # blocks in the queue
        self._free_run(self.usable_blocks)
        # Cached blocks -> reference count (0: unreferenced, in the queue, evictable).
        self.cache: dict[tuple, int] = {}
        # Prefix blocks cached more than once, as vLLM keeps them when two requests computed the
        # same block: (prefix key, index) -> the keys of its copies, oldest first (a lookup hits
        # the oldest).  A second copy's key is (prefix key, index, serial).
        self.copies: dict[tuple, list[tuple]] = {}
        self._copy_ids = count()
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # -- block pool -----------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.num_free

    def kv_cache_usage(self) -> float:
        if not self.usable_blocks:
            return 0.0
        return 1.0 - self.num_free / self.usable_blocks

    def num_evictable(self) -> int:
        """Cached blocks no running request holds (free, but a later request could hit them)."""
        return sum(1 for c in self.cache.values() if c == 0)

    def _free_run(self, n: int) -> None:
        """Append n blocks that hold nothing reusable to the free queue."""
        if n > 0:
            self.queue[next(self._run_ids)] = n
            self.num_free += n

    def _free_front(self, n: int) -> None:
        """Put n blocks without a hash at the FRONT of the free queue: vLLM reuses them first
        (and, with prefix caching off, every freed block is one of them)."""
        if n > 0:
            key = next(self._run_ids)
            self.queue[key] = n
            self.queue.move_to_end(key, last=False)
            self.num_free += n

    def _take(self, n: int) -> None:
        """Take n blocks from the head of the free queue, evicting the cached blocks taken."""
        self.num_free -= n
        q = self.queue
        while n:
            head = next(iter(q))
            c = q[head]
            if c > n:
                q[head] = c - n
                return
            del q[head]
            n -= c
            if head.__class__ is tuple:
                del self.cache[head]
                if self.copies:
                    self._drop_copy(head)

    def _block_key(self, req: Request, i: int) -> tuple:
        if i >= req.prefix_blocks:
            return (req.own_key, i)
        held = req.held
        return held[i] if held and i in held else (req.prefix_key, i)

    def _lookup(self, b: tuple) -> tuple | None:
        """The cached copy of prefix block b a lookup hits (the oldest), or None."""
        copies = self.copies.get(b) if self.copies else None
        if copies:
            return copies[0]
        return b if b in self.cache else None

    def _add_copy(self, b: tuple) -> tuple:
        """Cache a newly computed prefix block b, referenced once; a second copy when b is
        already cached (vLLM keeps both: either serves later hits)."""
        cache = self.cache
        copies = self.copies.get(b)
        if b not in cache:
            key = b
            if copies is not None:
                copies.append(b)
        else:
            key = (b[0], b[1], next(self._copy_ids))
            if copies is None:
                copies = self.copies[b] = [b]
            copies.append(key)
        cache[key] = 1
        return key

    def _drop_copy(self, key: tuple) -> None:
        b = key[:2]
        copies = self.copies.get(b)
        if copies is not None:
            copies.remove(key)
            if not copies:
                del self.copies[b]

    def _hold(self, req: Request, i: int, key: tuple) -> None:
        if len(key) == 3:
            if req.held is None:
                req.held = {}
            req.held[i] = key

    def _release(self, req: Request, keep: bool = False, in_flight: bool = False) -> None:
        """Give the request's blocks back, tail first as vLLM frees them, so eviction eats a
        request's blocks from their end and the leading ones, which later lookups hit, last.
        As vLLM's block pool does, blocks that carry a hash (full blocks of computed tokens,
        with prefix caching on) go to the back of the free queue and the others (the partial
        last block, blocks allocated ahead) to the front, to be reused first.
        `keep` (a preempted request, prefix caching on): its computed full blocks stay cached
        under the request's own key for its recompute."""
        shared, nb, pb = req.shared, req.num_blocks, req.prefix_blocks
        q, cache = self.queue, self.cache
        if not self.enable_prefix_caching:
            self._free_front(nb)
            req.num_blocks = 0
            return
        # A token still in flight (async scheduling): vLLM has hashed only the blocks of the
        # tokens it has seen.
        computed = req.num_computed - in_flight
        full = max(min(nb, computed // self.block_size), shared)
        self._free_front(nb - full)
        if keep:
            own_from = max(shared, min(pb, full))
            own = req.own_key
            for j in range(full - 1, own_from - 1, -1):
                ok: tuple[str | None, int] = (own, j)
                if ok in cache:  # a stale copy from an earlier preemption is still cached
                    self._free_run(1)
                else:
                    cache[ok] = 0
                    q[ok] = 1
                    self.num_free += 1
            self._free_run(own_from - shared)  # private copies of prefix blocks another request cached
        else:
            self._free_run(full - shared)
        for i in range(shared - 1, -1, -1):
            k = self._block_key(req, i)
            c = cache[k] - 1
            cache[k] = c
            if c == 0:
                q[k] = 1
                self.num_free += 1
        req.num_blocks = 0
        req.shared = 0
        req.held = None

    def _prefix_hits(self, req: Request) -> tuple[int, int]:
        """(leading blocks of the request in the cache, how many of them are unreferenced now):
        the shared prefix, then, for a preempted request, its own blocks kept cached."""
        cache, key = self.cache, req.prefix_key
        limit = (req.num_tokens - 1) // self.block_size  # compute >= 1 token
        pb = min(req.prefix_blocks, limit)
        hits = idle = 0
        while hits < pb:
            k = self._lookup((key, hits))
            if k is None:
                return hits, idle
            if cache[k] == 0:
                idle += 1
            hits += 1
        if req.num_preemptions and hits == req.prefix_blocks:
            own = req.own_key
            while hits < limit:
                c = cache.get((own, hits))
                if c is None:
                    break
                if c == 0:
                    idle += 1
                hits += 1
        return hits, idle

    def _register(self, req: Request, upto_tokens: int) -> None:
        """Put the request's newly full prefix blocks into the cache."""
        full = min(req.prefix_blocks, upto_tokens // self.block_size)
        key = req.prefix_key
        while req.shared < full:
            i = req.shared
            self._hold(req, i, self._add_copy((key, i)))
            req.shared = i + 1

    # -- requests ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        # Unique even when an id comes back after an abort: a new request must never hit the
        # blocks an earlier one with the same id left cached.
        req.own_key = f"\x00{self.num_added}"
        self.num_added += 1
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = FINISHED
        req.finish_reason = "abort"
        return req

    def _preempt(self, req: Request) -> None:
        # Async scheduling: a decode of the previous step whose input token (sampled the step
        # before) vLLM has not yet seen.
        in_flight = self.async_scheduling and req.step_chained == self._k - 1
        self._release(req, keep=self.enable_prefix_caching, in_flight=in_flight)
        req.num_computed = 0
        req.status = WAITING
        req.num_preemptions += 1
        req.register_ok = True
        self.waiting.appendleft(req)
        self.num_preemptions_total += 1

    def _grow(self, req: Request, total: int) -> tuple[int, bool]:
        """Give a running request the blocks to hold `total` tokens, preempting the LAST running
        request until they fit (vLLM's FCFS policy).  Returns (preemptions, scheduled): not
        scheduled when the request had to preempt itself."""
        block_size = self.block_size
        num_new_blocks = (total + block_size - 1) // block_size - req.num_blocks
        running = self.running
        num_preempted = 0
        while num_new_blocks > self.num_free:
            victim = running.pop()
            self._preempt(victim)
            num_preempted += 1
            if victim is req:
                return num_preempted, False
        self._take(num_new_blocks)
        req.num_blocks += num_new_blocks
        if self.enable_prefix_caching and req.prefix_key is not None and req.register_ok:
            self._register(req, total)
        return num_preempted, True

    # -- the step ---------------------------------------------------------------------------
    def step(self, k: int) -> StepOutcome:
        """Schedule step `k` (>= 1), apply it and say what it did (a `StepOutcome`).  Requests are
        updated as they are scheduled, in one pass: nothing later in the step reads an earlier
        request (preemption victims come from the tail of the running list)."""
        self._k = k
        budget = self.max_num_batched_tokens
        block_size = self.block_size
        running = self.running
        defer, cap_prefill, threshold = self._step_limits(budget)
        prefix_caching = self.enable_prefix_caching
        scheduled: list[Request] = []
        finished: list[Request] = []
        gaps: list[tuple[int, int]] = []
        append = scheduled.append
        num_preemptions = num_sampled = num_steady = decode_kv_tokens = 0
        prefill_pairs = 0.0
        prev_step = k - 1

        i = 0
        num_running = len(running)
        while i < num_running and budget > 0:
            req = running[i]
            num_computed_tokens = req.num_computed
            num_tokens = req.num_tokens
            num_new_tokens = num_tokens - num_computed_tokens
            if num_new_tokens == 1:
                # A decode (or the last token of a prompt): the common case, kept short.
                if req.num_output >= req.max_tokens or (defer and req.sched > 0):
                    # Async scheduling: its last token is in flight; vLLM skips it (it keeps its
                    # slot and blocks until the output is processed after this schedule).  Or
                    # the last token of a prompt, held back by --prefill-schedule-interval.
                    i += 1
                    continue
                if num_tokens > req.num_blocks * block_size:
                    num_preempted, can_schedule = self._grow(req, num_tokens)
                    if num_preempted:
                        num_preemptions += num_preempted
                        num_running = len(running)
                    if not can_schedule:
                        break
                append(req)
                budget -= 1
                req.num_computed = num_tokens
                decode_kv_tokens += num_tokens
                num_sampled += 1
                req.num_tokens = num_tokens + 1
                num_output = req.num_output + 1
                req.num_output = num_output
                req.sched = -1
                last_token_step = req.step_last_token
                if last_token_step == prev_step:  # k >= 1, so prev_step >= 0: a request with no token yet never matches
                    num_steady += 1
                    req.step_chained = k
                elif last_token_step < 0:
                    req.step_first_token = k
                else:
                    gaps.append((last_token_step, k))
                req.step_last_token = k
                if num_output >= req.max_tokens:
                    finished.append(req)
                i += 1
                continue
            if defer and req.sched > 0:
                i += 1  # a prefill chunk held back by --prefill-schedule-interval
                continue
            if cap_prefill and num_new_tokens > threshold:
                num_new_tokens = threshold
            if num_new_tokens > budget:
                num_new_tokens = budget
            total = num_computed_tokens + num_new_tokens
            if total > req.num_blocks * block_size:
                num_preempted, can_schedule = self._grow(req, total)
                if num_preempted:
                    num_preemptions += num_preempted
                    num_running = len(running)
                if not can_schedule:
                    break
            elif prefix_caching and req.prefix_key is not None and req.shared < req.prefix_blocks:
                # vLLM caches the blocks this step fills even when it needs no new block: a
                # request admitted later in this very step hits them.
                self._register(req, total)
            req.sched = num_new_tokens
            append(req)
            budget -= num_new_tokens
            req.num_computed = total
            prefill_pairs += num_new_tokens * (num_computed_tokens + (num_new_tokens + 1) * 0.5)
            if total == num_tokens:
                num_sampled += 1
                req.sched = -num_new_tokens
                num_steady += _sample(req, k, finished, gaps)
            i += 1

        outcome = StepOutcome(scheduled, finished, 0, num_preemptions, prefill_pairs, decode_kv_tokens, num_sampled,
                              num_steady, gaps)
        self._end_step(outcome, k, budget, defer, cap_prefill, threshold)
        return outcome

    def _step_limits(self, budget: int) -> tuple[bool, bool, int]:
        """Whether this step defers prefills, whether prefill chunks are capped, and the cap.

        --prefill-schedule-interval N, as vLLM's data-parallel engine core applies it: on steps off
        the N-step cadence (counted from when the engine last went idle), hold back prefills --
        running prefill chunks and new admissions -- while some request decodes, unless the last
        admitting step left requests waiting (prefill capacity bound)."""
        interval = self.prefill_schedule_interval
        defer = (interval > 1 and self._wave_step % interval != 0 and not self._prefill_capacity_bound
                 and any(r.sched < 0 for r in self.running))
        threshold = self.long_prefill_token_threshold
        num_eligible = len(self.running) + len(self.waiting)
        cap_prefill = threshold > 0 and num_eligible > 1
        if cap_prefill and self.long_prefill_token_threshold_adaptive:
            # --long-prefill-token-threshold-adaptive: never below a fair share of the budget.
            threshold = max(threshold, budget // num_eligible)
        return defer, cap_prefill, threshold

    def _end_step(self, outcome: StepOutcome, k: int, budget: int, defer: bool, cap_prefill: bool,
                  threshold: int) -> None:
        """After the running requests: admit waiting ones (only in a step that preempted nothing),
        then retire what finished (under async scheduling, the previous step's) and count the step."""
        waiting = self.waiting
        if not outcome.num_preemptions:
            if waiting:
                budget = self._schedule_waiting(outcome, k, budget, defer, cap_prefill, threshold)
            if not defer:
                self._prefill_capacity_bound = bool(waiting)
        finished = outcome.finished
        for req in finished:
            req.finish_reason = "length"
        if self.async_scheduling:
            # vLLM processes the previous step's output only now, after this schedule().
            finished_now, self._finishing = self._finishing, finished
        else:
            finished_now = finished
        if finished_now:
            self._retire(finished_now)
        self._wave_step = self._wave_step + 1 if (self.running or waiting) else 0
        outcome.total_num_scheduled_tokens = self.max_num_batched_tokens - budget

    def _schedule_waiting(self, outcome: StepOutcome, k: int, budget: int, defer: bool, cap_prefill: bool,
                          threshold: int) -> int:
        """Admit waiting requests into step `k` (vLLM's loop over the waiting queue), adding them to
        `outcome`; returns the token budget left."""
        block_size = self.block_size
        prefix_caching = self.enable_prefix_caching
        running, waiting = self.running, self.waiting
        append, finished, gaps = outcome.scheduled.append, outcome.finished, outcome.gaps
        prefill_pairs, decode_kv_tokens = outcome.prefill_pairs, outcome.decode_kv_tokens
        num_sampled, num_steady = outcome.num_sampled, outcome.num_steady
        max_num_seqs = self.max_num_seqs
        watermark_blocks = self.watermark_blocks
        while waiting and budget > 0 and len(running) < max_num_seqs:
            req = waiting[0]
            num_hit_blocks = num_idle_hits = 0
            if prefix_caching and (req.prefix_key is not None or req.num_preemptions):
                num_hit_blocks, num_idle_hits = self._prefix_hits(req)
            num_computed_tokens = num_hit_blocks * block_size
            num_tokens = req.num_tokens
            num_new_tokens = num_tokens - num_computed_tokens
            if defer and num_new_tokens > 1:
                break
            if cap_prefill and num_new_tokens > threshold:
                num_new_tokens = threshold
            if num_new_tokens > budget:
                num_new_tokens = budget
            total = num_computed_tokens + num_new_tokens
            # vLLM applies the watermark only while some request runs: an idle engine
            # admits whatever fits, or a prompt longer than (pool - watermark) never starts.
            free = self.num_free - num_idle_hits - (watermark_blocks if running else 0)
            num_new_blocks = (total + block_size - 1) // block_size - num_hit_blocks
            if self.reserve_full_isl:
                if (num_tokens + block_size - 1) // block_size - num_hit_blocks > free:
                    break
            elif num_new_blocks > free:
                break
            waiting.popleft()
            if num_hit_blocks:
                self._hold_hits(req, num_hit_blocks, num_idle_hits)
            if prefix_caching and not req.num_preemptions:
                # vLLM's prefix-cache stats count every new request's lookup (a preempted
                # request's second lookup is recorded apart).
                self.prefix_query_tokens += num_tokens
                self.prefix_hit_tokens += num_computed_tokens
            req.shared = num_hit_blocks
            req.num_blocks = num_hit_blocks
            self._take(num_new_blocks)
            req.num_blocks += num_new_blocks
            if prefix_caching and req.prefix_key is not None and req.register_ok:
                self._register(req, total)
            req.status = RUNNING
            running.append(req)
            # -- apply (as in the running loop) --
            req.sched = num_new_tokens
            append(req)
            budget -= num_new_tokens
            req.num_computed = total
            if num_new_tokens == 1:
                decode_kv_tokens += total
            else:
                prefill_pairs += num_new_tokens * (num_computed_tokens + (num_new_tokens + 1) * 0.5)
            if req.step_scheduled < 0:
                req.step_scheduled = k
            if total == num_tokens:
                num_sampled += 1
                req.sched = -num_new_tokens
                num_steady += _sample(req, k, finished, gaps)
        outcome.prefill_pairs, outcome.decode_kv_tokens = prefill_pairs, decode_kv_tokens
        outcome.num_sampled, outcome.num_steady = num_sampled, num_steady
        return budget

    def _hold_hits(self, req: Request, num_hit_blocks: int, num_idle_hits: int) -> None:
        """An admitted request takes the cached blocks its prefix hit (`_prefix_hits`): a reference
        each, out of the free queue the `num_idle_hits` unreferenced ones."""
        cache, queue = self.cache, self.queue
        prefix_blocks = req.prefix_blocks
        for block_index in range(num_hit_blocks):
            key: tuple = (req.own_key, block_index)
            if block_index < prefix_blocks:
                found = self._lookup((req.prefix_key, block_index))
                assert found is not None  # _prefix_hits found it
                key = found
                self._hold(req, block_index, key)
            refs = cache[key]
            if refs == 0:
                del queue[key]
            cache[key] = refs + 1
        self.num_free -= num_idle_hits

    def _retire(self, finished: list[Request]) -> None:
        """Free finished requests' slots and blocks (vLLM's update_from_output)."""
        for req in finished:
            if req.status == WAITING:  # preempted while its last token was in flight
                self.waiting.remove(req)
            elif req.status == RUNNING:
                self._release(req)
            else:  # aborted meanwhile
                continue
            req.status = FINISHED
            del self.requests[req.request_id]
        self.running = [r for r in self.running if r.status == RUNNING]

    def only_finishing(self) -> bool:
        """Async scheduling: every request left has its last token in flight (nothing to schedule)."""
        return bool(self._finishing) and not self.waiting and len(self.running) == len(self._finishing)

    def flush(self) -> None:
        """Process the last step's output without scheduling another (an engine going idle)."""
        finishing, self._finishing = self._finishing, []
        self._retire(finishing)
        if not (self.running or self.waiting):
            self._wave_step = 0

    def check_invariants(self) -> None:
        """Raise AssertionError if the block accounting is inconsistent (for tests)."""
        held_private = sum(r.num_blocks - r.shared for r in self.running)
        for r in self.waiting:
            assert r.num_blocks == 0, f"waiting request {r.request_id} holds blocks"
        referenced = sum(1 for c in self.cache.values() if c > 0)
        queued = sum(self.queue.values())
        assert queued == self.num_free >= 0, (queued, self.num_free)
        assert all(c > 0 for c in self.queue.values())
        used = held_private + referenced
        assert used + self.num_free == self.usable_blocks, (used, self.num_free, self.usable_blocks)
        assert len(self.running) <= self.max_num_seqs
        refs: dict[tuple[str | None, int], int] = {}
        for r in self.running:
            for j in range(r.shared):
                k = self._block_key(r, j)
                refs[k] = refs.get(k, 0) + 1
        for k, c in self.cache.items():
            assert refs.get(k, 0) == c, (k, c, refs.get(k, 0))
            assert (c == 0) == (k in self.queue), k
            if c == 0:
                assert self.queue[k] == 1
        for qk in self.queue:
            assert isinstance(qk, int) or qk in self.cache, qk
        for b, keys in self.copies.items():
            assert keys and all(k in self.cache and k[:2] == b for k in keys), (b, keys)
        dups = [k for k in self.cache if len(k) == 3]
        assert all(k in self.copies.get(k[:2], ()) for k in dups), dups
