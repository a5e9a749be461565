"""The KV cache manager: the sequence lifecycle (claim, append, fetch, release) over pool and storage."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..deprecation import RenamedAttribute, renamed_keywords
from ..errors import KVCacheExhausted, MlxkvError, UnknownSequenceError
from ..settings import BOOLEAN, POSITIVE, integer, require
from .batch import KVBatch
from .disk.namespace import DiskSpec, namespace
from .disk.pages import DiskPages
from .disk.peers import DiskMoves, PeerCheck
from .disk.tier import DiskTier
from .layout import KVLayout, resolve_layout
from .page_group import PageGroup, window_pool_pages
from .page_table import PageTable
from .pins import PrefixPins
from .pool import PagePool
from .prefix_cache import Marks, chain_keys, root_key
from .state_pool import StatePool, StateShape
from .state_snapshots import State, StateSnapshots, state_key
from .storage import KVStorage, Pages, PerLayer, check_quantization, per_layer
from .usage import KVUsage

logger = logging.getLogger(__name__)

RestorePays = Callable[[int, int, float], bool]
"""`(tokens in place, tokens on disk after them, seconds to read them)`: whether reading beats computing them."""


def prefix_cached(
    layout: KVLayout, prefix_caching: bool, hybrid: bool, kv_bits: int | None, prefix_states: int
) -> bool:
    """Whether a cache shares prefixes: asked for, paged (a contiguous page is one sequence's), and
    for a hybrid model states kept for it (`prefix_states`) and float pages (its snapshot point
    would cut the first chunk that quantized pages need whole, see `Scheduler.own_kv_span`)."""
    shares = prefix_caching and layout is KVLayout.PAGED
    return shares and not (hybrid and (kv_bits or not prefix_states))


def _counts(num_new_tokens: Sequence[int]) -> list[int]:
    """`num_new_tokens` as a list of ints, checked in one vector pass: non-negative integers."""
    try:
        counts = np.asarray(num_new_tokens)
    except (TypeError, ValueError):  # ragged nesting
        counts = None
    if counts is None or (counts.size and (counts.ndim != 1 or counts.dtype.kind not in "iu" or counts.min() < 0)):
        raise ValueError(f"num_new_tokens must be non-negative integers, got {list(num_new_tokens)}")
    values: list[int] = counts.tolist()
    return values


@renamed_keywords(max_seqs="max_num_seqs", max_seq_len="max_model_len", block_size="page_size", num_blocks="num_pages")
class KVCacheManager:
    """Per-sequence KV caches over one page pool, in either layout.

    Lifecycle: `claim` sequence ids, `reuse_prefix` to start one from cached pages, `append`
    new tokens (pages are taken on demand) and `write` each layer's K/V through the returned
    batch's slot mapping, `publish` the pages those tokens filled once their K/V are
    evaluated, `fetch` what attention needs, `release` when done.

    With `kv_bits` (8 or 4) pages hold K and V quantized along `head_dim` in groups of
    `kv_group_size` (see `QuantizedPages`); `kv` then returns quantized pages.

    Prefix caching (on by default) applies to the paged layout only: a contiguous page
    belongs to one sequence, so there is nothing to share and `prefix_caching` is False.

    `num_kv_heads` and `head_dim` are one int for every layer, or one per layer where a model's
    layers differ (Gemma 4's global layers have wider heads than its sliding ones). The layers in
    `keys_only` keep K pages alone, read as their V pages too (multi-head latent attention's
    latent rows, see `KVStorage`).

    `layer_windows` gives each layer's sliding window (None: it sees every earlier token).
    In the paged layout the layers of each window get pages of their own (a `PageGroup`
    of `window_pages[window]` pages, by default enough that they never run out): a sequence holds
    there only the pages its window reaches, and the scheduler counts the full-attention
    layers' pages alone. Its full pages are cached under the full-attention pages' keys as they
    fill, so a prefix is reused only as far as each window group still has the pages its window
    reaches at the prefix's end.

    With prefix caching, `pin` keeps a sequence's leading pages from eviction for a while (see
    `PrefixPins`), at most `pinned_fraction` of the pool.

    `state_shapes` gives each recurrent layer of a hybrid model the arrays it keeps per sequence
    (`StatePool`; the layers numbered apart from the attention layers): a sequence's state index
    is its index, taken by `claim` and given back by `release`. Cached pages alone do not give a
    recurrent layer its state at a prefix's end, so a hybrid's state is kept (`StateSnapshots`, up
    to `prefix_states` of them, by default `max_num_seqs`) where its prompt's last full page before
    its last token ends, its `snapshot_point`: `capture` takes it after the step that reaches it
    and `publish` files it under that page's key. `reuse_prefix` then reuses pages only as far as a kept state reaches,
    and starts the sequence from that state.

    Thread safety: one re-entrant lock serialises every public method, so `claim`, `append`,
    `fetch` and `release` may be called from any thread. The tensors are different: MLX
    evaluates a lazy graph only on the thread that built it (another thread gets "There is
    no Stream(cpu, N) in current thread"), so a thread that calls `write` owns the tensors
    until it calls `evaluate` (once per step), and a `write` from any other thread meanwhile is
    refused with `MlxkvError`. After `evaluate` any thread may write: an engine may move
    between threads from one step to the next.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: PerLayer,
        head_dim: PerLayer,
        *,
        max_num_seqs: int,
        max_model_len: int,
        layout: str | KVLayout | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        dtype: mx.Dtype | str = mx.float16,
        prefix_caching: bool = True,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        layer_windows: Sequence[int | None] | None = None,
        window_pages: dict[int, int] | None = None,
        state_shapes: Sequence[Sequence[StateShape]] = (),
        prefix_states: int | None = None,
        pinned_fraction: float = 0.5,
        keys_only: Sequence[int] = (),
        disk: DiskSpec | None = None,
    ) -> None:
        sizes = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, page_size=page_size)
        for name, value in sizes.items():
            require(name, value, POSITIVE)
        require("num_layers", num_layers, integer(0) if state_shapes else POSITIVE)  # a pure recurrent model has none
        heads, dims = per_layer("num_kv_heads", num_kv_heads, num_layers), per_layer("head_dim", head_dim, num_layers)
        require("prefix_caching", prefix_caching, BOOLEAN)
        check_quantization(kv_bits, kv_group_size, dims)
        self.layout = resolve_layout(layout)
        windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries for {num_layers} layers")
        grouped = self.layout is KVLayout.PAGED and any(windows)
        hybrid = bool(state_shapes)
        kept = max_num_seqs if prefix_states is None else prefix_states
        self.prefix_caching = prefix_cached(self.layout, prefix_caching, hybrid, kv_bits, kept)
        self.states = StatePool(max_num_seqs, state_shapes) if hybrid else None
        self.snapshots = StateSnapshots(kept) if hybrid and self.prefix_caching else None
        self._captured: dict[int, tuple[int, State]] = {}  # seq_id: (tokens, state) until published
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        if self.layout is KVLayout.PAGED:
            self.max_pages_per_seq = -(-max_model_len // page_size)
            pages = num_pages if num_pages is not None else max_num_seqs * self.max_pages_per_seq
            self.pool = PagePool(pages, page_size)
        else:
            self.max_pages_per_seq = 1
            self.pool = PagePool(max_num_seqs, max_model_len)
        pinnable = int(pinned_fraction * self.pool.capacity)
        self.pins = PrefixPins(self.pool, pinnable) if self.prefix_caching and pinnable else None
        self._free_indices = list(range(max_num_seqs - 1, -1, -1))
        self._index_of: dict[int, int] = {}
        self.groups: dict[int | None, PageGroup] = {}
        self._where: dict[int, tuple[int | None, int]] = {}  # layer: (its group's window, its index there)
        for window in [None] + (sorted({w for w in windows if w}) if grouped else []):
            layers = [i for i, w in enumerate(windows) if (w if grouped else None) == window]
            pool = self.pool if window is None else PagePool(self._window_pages(window, window_pages), page_size)
            shape = (len(layers), pool.capacity, [heads[i] for i in layers], pool.page_size, [dims[i] for i in layers])
            own = [index for index, layer in enumerate(layers) if layer in keys_only]
            self.groups[window] = self._page_group(
                window, layers, pool, KVStorage(*shape, dtype, kv_bits, kv_group_size, own)
            )
        self._full = self.groups[None]
        self._tables = self._full.tables
        self.windowed = {window: group for window, group in self.groups.items() if window is not None}
        self._ends_anywhere = not self.windowed and self.snapshots is None  # a prefix may end on any full page
        self._next_id = 0
        self._lock = threading.RLock()
        self._tensor_thread: int | None = None
        self.disk = self._disk_tier(disk) if disk is not None and self.prefix_caching else None
        self._on_disk = DiskPages(self.disk) if self.disk is not None else None
        self.peak_usage = self.usage()  # of the step holding the most pages (see `reset_peak_usage`)

    def _disk_tier(self, disk: DiskSpec) -> DiskTier | None:
        """The disk tier `disk` asks for; None, with one line, where its folder cannot be made."""
        try:
            windows = {window: group.storage for window, group in self.windowed.items()}
            return DiskTier(disk.folder, namespace(disk.model, self.storage, windows), disk.max_bytes)
        except OSError as exc:
            logger.warning("disk cache: cannot use %s (%s); running without it", disk.folder, exc.strerror or exc)
            return None

    def share_disk(self, peers: PeerCheck) -> None:
        """Make this rank 0 of a tensor-parallel group whose other ranks keep disk tiers of their own:
        what its tier files and restores is kept for the step plans (`take_moves`), and a page is
        restored only once `peers` says every other rank holds it read."""
        assert self._on_disk is not None, "only a cache with a disk tier shares it"
        self._on_disk.share(peers)

    def take_moves(self) -> DiskMoves | None:
        """What the disk tier filed and restored since the last call (None unless `share_disk`)."""
        with self._lock:
            return self._on_disk.take_moves() if self._on_disk is not None else None

    def follow_moves(self, moves: DiskMoves) -> None:
        """Do with this rank's disk tier what rank 0's did (`moves`, from its step plan; see
        `DiskPages.follow`). A rank without one answered that it lacks every page, so was asked to
        restore none."""
        with self._lock:
            if self._on_disk is None:
                if moves.restored:
                    raise MlxkvError("this rank has no disk cache, yet rank 0 restored pages from disk")
                return
            self._on_disk.follow(moves, {window: group.storage for window, group in self.groups.items()})
            self._tensor_thread = threading.get_ident()

    def _page_group(self, window: int | None, layers: list[int], pool: PagePool, storage: KVStorage) -> PageGroup:
        """`layers`' page group, its page tables in a matrix of a line per sequence index."""
        self._where.update({layer: (window, index) for index, layer in enumerate(layers)})
        matrix = np.zeros((self.max_num_seqs, self.max_pages_per_seq), np.int32)
        return PageGroup(window, layers, pool, storage, {}, matrix)

    def _window_pages(self, window: int, asked: dict[int, int] | None) -> int:
        """The pages of `window`'s group: as `asked`, else enough that it never runs out."""
        return (asked or {}).get(window) or window_pool_pages(
            window, self.page_size, self.max_num_seqs, self.max_model_len
        )

    @property
    def storage(self) -> KVStorage:
        """The full-attention layers' K/V pages."""
        return self._full.storage

    @property
    def page_size(self) -> int:
        """Tokens per page (`max_model_len` in the contiguous layout)."""
        return self.pool.page_size

    @property
    def dtype(self) -> mx.Dtype:
        return self.storage.dtype

    @property
    def kv_bits(self) -> int | None:
        return self.storage.bits

    @property
    def kv_group_size(self) -> int:
        return self.storage.group_size

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def claim(self, n: int = 1) -> list[int]:
        """Open `n` new sequences (all or nothing) and return their ids."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        with self._lock:
            room = self.max_num_seqs - len(self._tables)
            if self.layout is KVLayout.CONTIGUOUS:
                room = min(room, self.pool.free_count)
            if n > room:
                raise KVCacheExhausted(n, room, "sequences")
            ids = list(range(self._next_id, self._next_id + n))
            self._next_id += n
            for seq_id in ids:
                index = self._index_of[seq_id] = self._free_indices.pop()
                for group in self.groups.values():
                    group.matrix[index] = 0
                    group.tables[seq_id] = PageTable(group.pool, seq_id, self.max_model_len, group.matrix[index])
                if self.layout is KVLayout.CONTIGUOUS:
                    self._tables[seq_id].reserve_pages(1)
            return ids

    def reuse_prefix(
        self,
        seq_id: int,
        tokens: Sequence[int],
        salt: str | None = None,
        marks: Marks = (),
        restore_pays: RestorePays | None = None,
        keys: list[bytes] | None = None,
    ) -> int:
        """Start the new sequence `seq_id` from the cached pages of `tokens`' prefix (its full
        pages, never the last token): the pool's, then the disk tier's where `restore_pays` says
        reading them beats computing them (always, without it); returns how many tokens it now
        holds (0 with prefix caching off). Sequences share pages only when their `salt`s are
        equal, and only up to their first unequal mark (an image's digest at its first placeholder).
        With window groups or recurrent state, only as far as each can continue (`_can_end`).
        `keys`: `prompt_keys` of the same, if the caller has them."""
        with self._lock:
            table = self._table(seq_id)
            if not self.prefix_caching:
                return 0
            table.reuse_prefix(tokens, salt, marks, self._ends_anywhere, keys)
            if self.disk is not None:
                self._restore(table, tokens, restore_pays, keys)
            reused = table.num_tokens if self._ends_anywhere else self._settle(seq_id, table)
            if self._on_disk is not None:
                self._on_disk.admitted()
            return reused

    def prompt_keys(self, tokens: Sequence[int], salt: str | None = None, marks: Marks = ()) -> list[bytes]:
        """The keys of the full pages of `tokens` before its last token: the chain `restoring` and
        `reuse_prefix` walk, which a caller asking about one prompt step after step computes once."""
        return chain_keys(root_key(salt), tokens, marks, 0, (len(tokens) - 1) // self.page_size, self.page_size)

    def restoring(self, keys: list[bytes], restore_pays: RestorePays | None = None) -> bool:
        """Whether pages of the prompt whose `prompt_keys` are `keys` that the pool lacks and the
        disk tier holds (and that pay to restore) are still being read: a read ahead starts here
        if none has, and the request waits for it rather than any step for the disk."""
        if self._on_disk is None:
            return False
        with self._lock:
            self._on_disk.weigh()
            first = next((i for i, key in enumerate(keys) if self.pool.lookup(key) is None), len(keys))
            count = self._restorable(keys, first)
            size = self.page_size
            seconds = self._on_disk.tier.read_seconds(count * size * self.storage.bytes_per_token)
            if count and restore_pays is not None and not restore_pays(first * size, count * size, seconds):
                count = 0
            end = first + count
            wanted = keys[first:end] + self._window_reads(keys[:end])
            return not self._on_disk.ready([key for key in wanted if self._on_disk.may_restore(key)])

    def _restore(
        self, table: PageTable, tokens: Sequence[int], restore_pays: RestorePays | None, keys: list[bytes] | None
    ) -> None:
        """Continue `table`, which ends on the last page the pool had, with the pages of `tokens`
        the disk tier holds (never the last token's), read into free pages; `keys`: the prompt's
        page keys, if computed already."""
        assert self.disk is not None and self._on_disk is not None
        first = len(table.keys)
        wanted = (len(tokens) - 1) // self.page_size - first
        if wanted <= 0 or table.num_tokens != first * self.page_size:  # a partial page: the pool had more
            return
        chain = keys if keys is not None else table.keys + table.next_keys(tokens, wanted)
        count = min(self._restorable(chain, first), self.pool.free_count)
        size = self.page_size
        seconds = self.disk.read_seconds(count * size * self.storage.bytes_per_token)
        if count and restore_pays is not None and not restore_pays(table.num_tokens, count * size, seconds):
            return
        arrays = self.disk.read(chain[first : first + count]) if count else []
        if arrays:
            pages = self.pool.alloc(table.owner, arrays[0].shape[0])
            self.storage.put_pages(pages, arrays)
            table.adopt(pages, chain[first : first + len(pages)])
            self._on_disk.restored(None, pages, table.keys[first:])
            self._tensor_thread = threading.get_ident()

    def _restorable(self, chain: list[bytes], first: int) -> int:
        """How many of the pages of `chain` after its first `first` (those in place) to restore from
        disk: as many as it holds in a row, cut back to the deepest end `_can_end` allows."""
        assert self._on_disk is not None
        count = self._on_disk.found(chain[first:])
        if self._ends_anywhere:
            return count
        return next((c for c in range(count, 0, -1) if self._can_end(chain, first + c)), 0)

    def _can_end(self, chain: list[bytes], end: int) -> bool:
        """Whether a sequence can continue from the prefix of full pages `chain[:end]`: each window
        group has the pages its window reaches there, and a hybrid the state at its end (in
        memory or on disk)."""
        if self.snapshots is not None and not self._has_state(chain[end - 1]):
            return False
        return all(
            self._has_page(group, chain[page])
            for group in self.windowed.values()
            for page in range(end - 1, group.reach(end) - 1, -1)  # the last first: it is the likeliest missing
        )

    def _has_page(self, group: PageGroup, key: bytes) -> bool:
        return group.pool.lookup(key) is not None or (
            self._on_disk is not None and self._on_disk.may_restore(group.disk_key(key))
        )

    def _has_state(self, key: bytes) -> bool:
        assert self.snapshots is not None
        return key in self.snapshots or (self._on_disk is not None and self._on_disk.may_restore(state_key(key)))

    def _window_reads(self, chain: list[bytes]) -> list[bytes]:
        """The disk keys of the window groups' pages that continuing from the prefix `chain` needs
        and their pools lack."""
        end = len(chain)
        return [
            group.disk_key(key)
            for group in self.windowed.values()
            for key in chain[group.reach(end) : end]
            if group.pool.lookup(key) is None
        ]

    def _settle(self, seq_id: int, table: PageTable) -> int:
        """Cut the pages `table` reused back to the deepest end every window group and a hybrid's
        state can continue from, and start those there; returns the tokens now in place (none
        if a page or state on disk turns out damaged)."""
        end = next((e for e in range(len(table.keys), 0, -1) if self._can_end(table.keys, e)), 0)
        table.truncate(end)
        if end and not (self._start_windows(seq_id, table.keys) and self._start_state(seq_id, table.keys[end - 1])):
            for group in self.windowed.values():
                group.tables[seq_id].release()
            table.truncate(0)
        return table.num_tokens

    def _start_windows(self, seq_id: int, chain: list[bytes]) -> bool:
        """Give each window group's table of `seq_id` the pages its window reaches at the end of the
        prefix `chain`: the pool's, shared, and the rest read from disk into free pages (and
        cached). False if the disk gives back fewer than it should."""
        end = len(chain)
        for group in self.windowed.values():
            first = group.reach(end)
            wanted = chain[first:end]
            pages = [group.pool.lookup(key) for key in wanted]
            group.pool.share(seq_id, [page for page in pages if page is not None])
            missing = [i for i, page in enumerate(pages) if page is None]
            if missing:
                keys = [group.disk_key(wanted[i]) for i in missing]
                arrays = self.disk.read(keys) if self.disk is not None else []
                if not arrays or arrays[0].shape[0] != len(missing) or len(missing) > group.pool.free_count:
                    return False
                fresh = group.pool.alloc(seq_id, len(missing))
                group.storage.put_pages(fresh, arrays)
                for i, page in zip(missing, fresh):
                    pages[i] = page
                    group.pool.publish(page, wanted[i])
                if self._on_disk is not None:
                    self._on_disk.restored(group.window, fresh, keys)
                self._tensor_thread = threading.get_ident()
            group.tables[seq_id].start_window(chain, first, [int(page) for page in pages if page is not None])
        return True

    def _start_state(self, seq_id: int, key: bytes) -> bool:
        """Start a hybrid sequence's recurrent state from the one kept at the end of the page `key`
        (in memory, else on disk); False if its file is damaged. True without recurrent layers."""
        if self.snapshots is None or self.states is None:
            return True
        state = self._state(key)
        if state is None:
            return False
        index = mx.array([self._index_of[seq_id]])
        for layer, arrays in enumerate(state):
            self.states.write(layer, index, [array[None] for array in arrays])
        self._tensor_thread = threading.get_ident()
        return True

    def _state(self, key: bytes) -> State | None:
        """The state kept at the end of the page `key`: from memory, else from disk (None if its
        file is damaged)."""
        assert self.snapshots is not None and self.states is not None
        if key in self.snapshots:
            return self.snapshots.get(key)
        assert self.disk is not None
        arrays = [array[0] for array in self.disk.read([state_key(key)])]
        counts = [len(layer) for layer in self.states.arrays]
        if len(arrays) != sum(counts):
            return None
        ends = np.cumsum(counts)
        return [arrays[end - count : end] for count, end in zip(counts, ends)]

    def pin(self, seq_id: int, tokens: int, ttl_s: float) -> int:
        """Pin the full, published pages among the first `tokens` of sequence `seq_id` for
        `ttl_s` seconds; returns the tokens pinned (0 without prefix caching or such pages)."""
        with self._lock:
            table = self._table(seq_id)
            count = min(tokens // self.page_size, len(table.keys))
            if self.pins is None or count == 0:
                return 0
            return self.pins.pin(table.keys[count - 1], table.pages[:count], ttl_s) * self.page_size

    def expire_pins(self) -> None:
        """Lapse the pins whose time is up."""
        with self._lock:
            if self.pins is not None:
                self.pins.expire()

    def make_room(self, pages: int) -> None:
        """Lapse the oldest pins until `pages` pages are free, or no pin is left: a request is
        never kept waiting or preempted for a pin."""
        with self._lock:
            if self.pins is not None:
                self.pins.make_room(pages)

    def snapshot_point(self, prompt_tokens: int) -> int:
        """Where a prompt of `prompt_tokens` tokens has its recurrent state kept: the end of its last
        full page before its last token (0: nowhere, as without kept states)."""
        return (prompt_tokens - 1) // self.page_size * self.page_size if self.snapshots is not None else 0

    def capture(self, seq_ids: Sequence[int]) -> None:
        """Take the recurrent state of sequences whose step just reached their snapshot point, as
        this step leaves it (evaluated with the step; filed by `publish`). A sequence released
        since the step was scheduled (its request aborted meanwhile) is skipped."""
        assert self.states is not None
        with self._lock:
            for seq_id in seq_ids:
                index = self._index_of.get(seq_id)
                if index is None:
                    continue
                state = [[array[index] for array in layer] for layer in self.states.arrays]
                self._captured[seq_id] = (self._table(seq_id).num_tokens, state)

    def publish(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], num_computed: Sequence[int]) -> None:
        """Cache the pages filled by the first `num_computed[i]` of each sequence's `tokens[i]`,
        whose K/V are now evaluated (never before: a page is shared only once it holds its K/V)."""
        with self._lock:
            tables = self._tables_of(seq_ids)
            if self.prefix_caching:
                fresh = [(self._full, [(t, t.publish(ids, n)) for t, ids, n in zip(tables, tokens, num_computed)])]
                for group in self.windowed.values():
                    followers = [group.tables[seq_id] for seq_id in seq_ids]
                    fresh.append(
                        (group, [(f, f.follow(t.keys, n)) for f, t, n in zip(followers, tables, num_computed)])
                    )
                if self._on_disk is not None:
                    for group, published in fresh:
                        self._persist(self._on_disk, group, published)
            for seq_id, table in zip(seq_ids, tables):
                captured = self._captured.get(seq_id)
                if captured is not None and self.snapshots is not None and table.num_computed >= captured[0]:
                    key = table.keys[captured[0] // self.page_size - 1]
                    self.snapshots.put(key, captured[1])
                    if self.disk is not None and state_key(key) not in self.disk:
                        self.disk.put([state_key(key)], [array[None] for layer in captured[1] for array in layer])
                    del self._captured[seq_id]

    @staticmethod
    def _persist(on_disk: DiskPages, group: PageGroup, published: list[tuple[PageTable, list[int]]]) -> None:
        """File the pages of `group` just published (their copies are taken in the graph the step
        left, so the step's next writes still go in place)."""
        pages = [int(table.physical[i]) for table, indices in published for i in indices]
        keys = [group.disk_key(table.keys[i]) for table, indices in published for i in indices]
        on_disk.file(group.storage, group.window, pages, keys)

    def append(self, seq_ids: Sequence[int], num_new_tokens: Sequence[int]) -> KVBatch:
        """Append new tokens to sequences (all or nothing); returns where to write their K/V."""
        seq_ids, counts = tuple(seq_ids), _counts(num_new_tokens)
        if len(counts) != len(seq_ids):
            raise ValueError(f"got {len(seq_ids)} seq_ids but {len(counts)} num_new_tokens")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {list(seq_ids)}")
        with self._lock:
            self._tables_of(seq_ids)  # every one live
            tables = {window: [group.tables[s] for s in seq_ids] for window, group in self.groups.items()}
            needed = {}
            for window, group in self.groups.items():
                if window is not None:
                    for table in tables[window]:  # what this step's first query no longer sees
                        table.slide(table.num_tokens - window + 1)
                needed[window] = [table.pages_needed(n) for table, n in zip(tables[window], counts)]
                if sum(needed[window]) > group.pool.free_count:
                    raise KVCacheExhausted(sum(needed[window]), group.pool.free_count, group.kind)
            for window, group_tables in tables.items():
                for table, count, pages in zip(group_tables, counts, needed[window]):
                    table.extend(count, pages)
            if self.pool.used_count >= self.peak_usage.pages_used:
                self.peak_usage = self.usage()
            return self._batches(seq_ids, counts)

    def rewind(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the first `num_tokens` of sequence `seq_id`, which must cover every token it
        published: the speculative decoder's rejected draft tokens go, with the pages that held
        only them (their K/V are never read, and a later append writes over them)."""
        with self._lock:
            self._table(seq_id)
            for group in self.groups.values():
                group.tables[seq_id].rewind(num_tokens)

    def write(self, layer: int, batch: KVBatch, keys: mx.array, values: mx.array) -> None:
        """Store `layer`'s K/V for the new tokens of `batch` (`[tokens, kv_heads, head_dim]`)."""
        with self._lock:
            thread = threading.get_ident()
            if self._tensor_thread not in (None, thread):
                raise MlxkvError(
                    "KVCacheManager.write called from a thread other than the one that owns the "
                    "KV tensors until it calls evaluate; MLX evaluates a lazy graph only on the thread that built it"
                )
            window, index = self._layer(layer)
            storage = self.groups[window].storage
            storage.write(index, batch.for_window(window).head_slots(storage.kv_heads[index]), keys, values)
            self._tensor_thread = thread

    def evaluate(self, *outputs: mx.array, wait: bool = True) -> None:
        """Evaluate every K/V and state array, and `outputs` with them (a step's one evaluation);
        with `wait=False` only start it, as a pipelined step does. Either way the writes so far
        are no longer a graph of this thread's, so the next may come from any thread."""
        with self._lock:
            (mx.eval if wait else mx.async_eval)(*outputs, self.tensors)
            self._tensor_thread = None

    def fetch(self, seq_ids: Sequence[int]) -> KVBatch:
        """Page tables and context lengths of live sequences, for attention."""
        seq_ids = tuple(seq_ids)
        with self._lock:
            self._tables_of(seq_ids)  # every one live
            return self._batches(seq_ids, [0] * len(seq_ids))

    def release(self, seq_id: int) -> int:
        """Close a sequence and return its pages; returns how many it held."""
        with self._lock:
            self._table(seq_id)
            self._captured.pop(seq_id, None)
            self._free_indices.append(self._index_of.pop(seq_id))
            held = [group.tables.pop(seq_id).release() for group in self.groups.values()]
            return held[0]  # the full-attention layers' pages

    def reset(self) -> None:
        """Start the K/V tensors afresh and forget every cached page (no sequence may be open)."""
        with self._lock:
            if self._tables:
                raise MlxkvError(f"reset needs every sequence released; {len(self._tables)} are open")
            for group in self.groups.values():
                group.storage.reset()
            if self.states is not None:
                self.states.reset()
            if self.snapshots is not None:
                self.snapshots.clear()
            if self.pins is not None:
                self.pins.clear()
            self.pool.forget_cached()

    def kv(self, layer: int) -> tuple[Pages, Pages]:
        """The K and V pages of `layer`, `[pages, kv_heads, page_size, head_dim]` (quantized with `kv_bits`)."""
        window, index = self._layer(layer)
        return self.groups[window].storage.layer(index)

    @property
    def tensors(self) -> list[mx.array]:
        """Every array of every layer's K and V pages and recurrent state, to evaluate at the end of a step."""
        states = self.states.tensors if self.states is not None else []
        states += [array for _, state in self._captured.values() for layer in state for array in layer]
        return [t for group in self.groups.values() for t in group.storage.tensors] + states

    @property
    def nbytes(self) -> int:
        states = self.states.nbytes if self.states is not None else 0
        return sum(group.storage.nbytes for group in self.groups.values()) + states

    def _layer(self, layer: int) -> tuple[int | None, int]:
        """(the layer's page group: its window, or None for the full-attention pages; its index there)."""
        if layer not in self._where:
            raise IndexError(f"layer {layer!r} is outside 0..{len(self._where) - 1}")
        return self._where[layer]

    def as_tensor(self, seq_id: int, layer: int) -> tuple[mx.array, mx.array]:
        """One sequence's K and V in `layer` as contiguous `[tokens, kv_heads, head_dim]` copies.

        For inspection and tests; attention reads the pages in place instead. Call it on the
        thread that writes the K/V.
        """
        with self._lock:
            window, index = self._layer(layer)
            if window is not None:
                raise MlxkvError(f"layer {layer} keeps only the pages of its last {window} tokens")
            table = self._table(seq_id)
            return self.storage.read(index, table.pages[: table.pages_in_use], table.num_tokens)

    @property
    def pages_in_use(self) -> int:
        """Pages holding at least one token; a page shared by several sequences counts once."""
        with self._lock:
            return len({page for t in self._tables.values() for page in t.pages[: t.pages_in_use]})

    def reset_peak_usage(self) -> None:
        """Start tracking the peak use afresh (e.g. per chat turn): `peak_usage` is kept at each
        `append` that holds the most pages so far."""
        self.peak_usage = self.usage()

    def usage(self) -> KVUsage:
        with self._lock:
            # a page held by several sequences or pins counts once; shared and pinned pages are full
            pins = self.pins.references if self.pins is not None else 0
            shared_twice = (self.pool.extra_refs - pins) * self.page_size
            tokens = sum(t.num_tokens for t in self._tables.values()) - shared_twice
            windowed = tuple((window, group.usage(self.layout)) for window, group in self.windowed.items())
            return KVUsage(
                self.layout,
                self.pool.used_count,
                self.pool.capacity,
                self.page_size,
                tokens,
                self.storage.bytes_per_token,
                self.pool.cached_free_count,
                self.kv_bits,
                windowed,
                len(self._tables) if self.states is not None else 0,
                self.states.size if self.states is not None else 0,
                self.states.bytes_per_sequence if self.states is not None else 0,
                len(self.snapshots) if self.snapshots is not None else 0,
                self.pins.num_pages if self.pins is not None else 0,
                replace(self.disk.stats) if self.disk is not None else None,
            )

    @property
    def free_pages(self) -> int:
        return self.pool.free_count

    step = RenamedAttribute("append")
    blocks_in_use = RenamedAttribute("pages_in_use")
    block_size = RenamedAttribute("page_size")
    max_seqs = RenamedAttribute("max_num_seqs")
    max_seq_len = RenamedAttribute("max_model_len")
    num_active = RenamedAttribute("num_sequences")

    def pages_needed(self, seq_ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """New pages each sequence would take for its count of more tokens."""
        with self._lock:
            return [table.pages_needed(n) for table, n in zip(self._tables_of(seq_ids), counts)]

    def num_tokens(self, seq_id: int) -> int:
        with self._lock:
            return self._table(seq_id).num_tokens

    def _table(self, seq_id: int) -> PageTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise UnknownSequenceError(seq_id)
        return table

    def _tables_of(self, seq_ids: Sequence[int]) -> list[PageTable]:
        """The tables of live sequences (one lookup pass, as a step asks for hundreds)."""
        try:
            return [self._tables[seq_id] for seq_id in seq_ids]
        except KeyError as missing:
            raise UnknownSequenceError(missing.args[0]) from None

    def _batches(self, seq_ids: tuple[int, ...], counts: list[int]) -> KVBatch:
        """The batch of live `seq_ids` after their last `counts[b]` tokens were appended, with the
        same batch in each window group's pages."""
        indices = [self._index_of[seq_id] for seq_id in seq_ids]
        query_lens = np.array(counts, np.int32)
        states = np.array(indices, np.int32) if self.states is not None else None
        width = self.max_pages_per_seq
        by_window = {w: g.batch(seq_ids, indices, query_lens, width, states) for w, g in self.windowed.items()}
        return self._full.batch(seq_ids, indices, query_lens, width, states, by_window or None)
