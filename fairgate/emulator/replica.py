"""Continuous batching on a real clock: the iteration loop of one emulated replica.

Conventions as in ``shared/DESIGN.md`` (and the simulator): requests are admitted at iteration boundaries,
first come first served, up to ``max_batch`` running; an idle replica starts an iteration as soon as a
request arrives; a new sequence is prefilled in the iteration it joins and emits its first token at that
iteration's end; each iteration lasts ``dt = iter_base + iter_slope * B + prefill_ms_per_token * prompt
tokens admitted``. Iterations are scheduled against absolute deadlines (``start + dt``), so event-loop
jitter does not accumulate. A cancelled sequence leaves at the next boundary: it stops within one
iteration and frees its slot.

Automatic prefix caching (opt-in, ``prefix_caching=True``), as vLLM does it
(https://docs.vllm.ai/en/latest/design/prefix_caching.html): a prompt is cut into blocks of
``BLOCK_TOKENS`` tokens, each full block named by a chain hash of every token up to its end
(``block_hashes``), scoped by the request's ``cache_salt``. A sequence admitted into an iteration finds
the leading blocks of its prompt already cached under its salt and prefills only the rest; at least one
prompt token is always computed (an engine needs the last token's logits), so a prompt of whole cached
blocks recomputes its last block. Its blocks are then cached; the cache holds ``cache_blocks`` blocks and
evicts the least recently used. A sequence's ``cached_tokens`` is what it found; the iteration's time and
the charge rule count only the tokens it prefilled.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fairgate.core.cost import CostModel

BLOCK_TOKENS = 16  # tokens per KV-cache block: vLLM's default block_size, its unit of prefix caching
CACHE_BLOCKS_DEFAULT = 65_536  # blocks the prefix cache holds (1M tokens) unless told otherwise


def block_hashes(tokens: Iterable[str | int]) -> tuple[int, ...]:
    """The hash of each full block of ``BLOCK_TOKENS`` tokens of a prompt (a partial last block has none),
    as vLLM's prefix caching names blocks (https://docs.vllm.ai/en/latest/design/prefix_caching.html): block
    i's hash covers block i-1's hash and its own tokens, so equal hashes mean equal prompts up to the
    block's end. ``tokens``: words (str) or token ids (int), told apart. BLAKE2b, 64 bits: the same in
    every process (Python's ``hash`` of a str is salted per process)."""
    out: list[int] = []
    parent = b""
    block: list[str | int] = []
    for token in tokens:
        block.append(token)
        if len(block) == BLOCK_TOKENS:
            digest = hashlib.blake2b(parent, digest_size=8)
            for item in block:
                data = item.encode("utf-8", "surrogatepass") if isinstance(item, str) else str(item).encode()
                # Tagged and length-prefixed, so no two token lists give the same bytes.
                digest.update((b"s" if isinstance(item, str) else b"i") + len(data).to_bytes(4, "big") + data)
            parent = digest.digest()
            out.append(int.from_bytes(parent, "big"))
            block = []
    return tuple(out)


class PrefixCache:
    """The blocks a replica holds: ``(cache_salt, block hash)`` keys, at most ``capacity`` of them, least
    recently used evicted first. The salt is part of the key, so blocks are never shared across salts (vLLM
    mixes ``cache_salt`` into the first block's hash for the same effect)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the prefix cache needs capacity >= 1 block, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[str, int], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._blocks

    def leading_hits(self, salt: str, blocks: tuple[int, ...]) -> int:
        """How many leading ``blocks`` are cached under ``salt`` (a block past a miss is of no use: its KV
        depends on every token before it)."""
        hits = 0
        for block in blocks:
            if (salt, block) not in self._blocks:
                break
            hits += 1
        return hits

    def use(self, salt: str, blocks: tuple[int, ...]) -> None:
        """Cache ``blocks`` under ``salt`` as just used. Last block first, so a prompt's first blocks are the
        most recently used and its tail goes first (vLLM frees a request's blocks in reverse order for the
        same reason: a cached tail without its head is never hit)."""
        for block in reversed(blocks):
            key = (salt, block)
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@dataclass
class Sequence:
    """One request on the replica. ``events`` yields the index of each generated token, then ``None``."""

    prompt_tokens: int
    output_tokens: int  # tokens it will generate if not cancelled
    arrival_s: float
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    first_token_s: float | None = None
    events: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    cache_salt: str | None = None  # the tenant scope the gateway sent (vLLM's cache_salt)
    charged_ms: float = 0.0  # GPU ms by seed 002's charge rule over the iterations it ran in
    prompt_blocks: tuple[int, ...] = ()  # its prompt's block hashes (``block_hashes``), for prefix caching
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when admitted (not prefilled)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens its admitting iteration computes: the prompt less what was cached."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Iteration:
    """One iteration: planned start (s, monotonic clock), planned length and measured length (ms: from the
    previous iteration's end, or from the start after idle), batch size, prompt tokens prefilled, and prompt
    tokens of the sequences it admitted that were found cached instead (not in ``prefill_tokens``)."""

    start_s: float
    planned_ms: float
    measured_ms: float
    batch: int
    prefill_tokens: int
    cached_tokens: int = 0


class EmulatedReplica:
    """The iteration loop. ``start()`` runs it as a task on the current event loop.

    Args:
        cost: iteration-time model (ms) and ``max_batch``.
        clock: monotonic seconds (default ``time.monotonic``).
        keep_iterations: how many recent iterations ``iterations`` keeps (for tests and stats).
        prefix_caching: reuse cached prompt blocks (module docstring); off, every prompt is prefilled whole.
        cache_blocks: blocks of ``BLOCK_TOKENS`` tokens the prefix cache holds (LRU beyond).
    """

    def __init__(
        self,
        cost: CostModel,
        clock: Callable[[], float] = time.monotonic,
        keep_iterations: int = 10_000,
        prefix_caching: bool = False,
        cache_blocks: int = CACHE_BLOCKS_DEFAULT,
    ) -> None:
        self.cost = cost
        self.prefix_cache = PrefixCache(cache_blocks) if prefix_caching else None
        self._clock = clock
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.iterations: deque[Iteration] = deque(maxlen=keep_iterations)
        self.busy_ms = 0.0
        # Ground truth for the gateway's live meter: the charge rule applied to the real iterations, per
        # cache_salt (the gateway's tenant hash); "" for requests sent without one.
        self.charged_ms_by_salt: dict[str, float] = {}
        self.tokens_generated = 0
        self.sequences_finished = 0
        self.sequences_cancelled = 0

    # --- control ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="emulated-replica")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(
        self, prompt_tokens: int, output_tokens: int, cache_salt: str | None = None, prompt_blocks: tuple[int, ...] = ()
    ) -> Sequence:
        """Queue a request; it is admitted at the next boundary with a free slot. ``prompt_blocks``: the hash
        of each full block of its prompt (``block_hashes``); with prefix caching on, its cached leading
        blocks are not prefilled (module docstring).

        Raises:
            ValueError: ``output_tokens`` < 1, ``prompt_tokens`` < 0, or more blocks than the prompt has
                full blocks.
        """
        if output_tokens < 1 or prompt_tokens < 0:
            raise ValueError("a sequence needs prompt_tokens >= 0 and output_tokens >= 1")
        if len(prompt_blocks) > prompt_tokens // BLOCK_TOKENS:
            raise ValueError(
                f"{len(prompt_blocks)} prompt blocks for {prompt_tokens} tokens: at most one a full "
                f"{BLOCK_TOKENS}-token block"
            )
        seq = Sequence(
            prompt_tokens, output_tokens, self._clock(), cache_salt=cache_salt, prompt_blocks=tuple(prompt_blocks)
        )
        self._waiting.append(seq)
        self._wakeup.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq``: it generates nothing more and leaves its slot at the next boundary."""
        if not seq.finished and not seq.cancelled:
            seq.cancelled = True
            seq.events.put_nowait(None)

    # --- state ----------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return sum(1 for s in self._waiting if not s.cancelled)

    # --- the loop ---------------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (first come first served), finding each one's cached
        prompt tokens as it joins: one admitted earlier in the same iteration has already cached its blocks."""
        admitted: list[Sequence] = []
        while self._waiting and len(self._running) < self.cost.max_batch:
            seq = self._waiting.popleft()
            if seq.cancelled:
                continue
            if self.prefix_cache is not None and seq.prompt_blocks:
                salt = seq.cache_salt or ""
                hits = self.prefix_cache.leading_hits(salt, seq.prompt_blocks)
                # At least one token is computed: the engine needs the last prompt token's logits.
                most = (seq.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
                seq.cached_tokens = min(hits * BLOCK_TOKENS, most)
                self.prefix_cache.use(salt, seq.prompt_blocks)
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    async def _loop(self) -> None:
        start = self._clock()
        previous_end: float | None = None  # end of the previous iteration, if this one follows it directly
        while True:
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                start = self._clock()  # an idle replica starts at the arrival instant
                previous_end = None
            admitted = self._admit()
            prefill_tokens = sum(seq.prefilled_tokens for seq in admitted)
            batch = len(self._running)
            if batch == 0:
                continue
            planned_ms = self.cost.iteration_ms(batch, prefill_tokens)
            deadline = start + planned_ms / 1000.0
            # Always yield to the event loop, even when late: the HTTP side runs on the same loop.
            await asyncio.sleep(max(0.0, deadline - self._clock()))
            end = self._clock()
            # Measured from the previous iteration's end (tokens are seen at iteration ends), so a late
            # wake-up shows once and is made up by the next, shorter wait.
            began = previous_end if previous_end is not None else start
            cached = sum(seq.cached_tokens for seq in admitted)
            self.iterations.append(Iteration(start, planned_ms, (end - began) * 1000.0, batch, prefill_tokens, cached))
            # Late by more than an iteration (a stalled loop): restart the schedule from now.
            start = deadline if end - deadline < planned_ms / 1000.0 else end
            previous_end = end
            self.busy_ms += planned_ms
            decode_share_ms = self.cost.decode_ms(batch) / batch
            new = {id(seq) for seq in admitted}
            for seq in self._running:
                charge = decode_share_ms + (self.cost.prefill_ms(seq.prefilled_tokens) if id(seq) in new else 0.0)
                seq.charged_ms += charge
                salt = seq.cache_salt or ""
                self.charged_ms_by_salt[salt] = self.charged_ms_by_salt.get(salt, 0.0) + charge
            still: list[Sequence] = []
            for seq in self._running:
                if seq.cancelled:
                    self.sequences_cancelled += 1
                    continue
                seq.generated += 1
                self.tokens_generated += 1
                if seq.first_token_s is None:
                    seq.first_token_s = end
                seq.events.put_nowait(seq.generated)
                if seq.generated >= seq.output_tokens:
                    seq.finished = True
                    seq.events.put_nowait(None)
                    self.sequences_finished += 1
                else:
                    still.append(seq)
            self._running = still
