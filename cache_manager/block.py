"""KVBlock (metadata of one KV block) and BlockQueue (an intrusive doubly linked free list)."""

from __future__ import annotations

from collections.abc import Iterator


class KVBlock:
    """Metadata of one block of ``block_size`` token slots; the KV itself lives in the runner.

    ``block_hash`` is the prefix-cache key of a full, computed block (None: the block holds
    nothing reusable). ``parent_hash``, ``token_ids`` and ``cache_salt`` are kept with the key
    so a lookup is verified exactly, never trusted on the hash alone. ``prev``/``next`` link the
    block into the ``BlockQueue`` named by ``queue`` while it is free.
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "cache_salt",
        "hit_count",
        "is_shared",
        "is_spilled",
        "next",
        "num_filled",
        "parent_hash",
        "prev",
        "queue",
        "ref_count",
        "token_ids",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.cache_salt: str | None = None
        self.hit_count = 0  # prefix hits taken on this block since it got its key
        self.is_shared = False  # held by >1 request at once, or hit, since it got its key
        self.is_spilled = False  # tier 2 has (or is being given) its KV since it got its key
        self.num_filled = 0  # slots holding KV (max over holders); 0 while free
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None
        self.queue: BlockQueue | None = None

    def __repr__(self) -> str:
        key = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(block_id={self.block_id}, ref_count={self.ref_count}, block_hash={key})"


class BlockQueue:
    """Intrusive doubly linked list of free blocks, front = next to hand out.

    append, appendleft, popleft and remove are O(1) and allocate nothing: the links live in
    the blocks. A block is in at most one queue, recorded in ``block.queue``.
    """

    __slots__ = ("_head", "_len", "_tail", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        tail = self._tail
        while node is not tail:
            assert node is not None, f"{self.name}: broken next link"
            yield node
            node = node.next

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the back (handed out last)."""
        tail = self._tail
        last = tail.prev
        assert last is not None
        block.prev = last
        block.next = tail
        last.next = block
        tail.prev = block
        block.queue = self
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the front (handed out next)."""
        head = self._head
        first = head.next
        assert first is not None
        block.prev = head
        block.next = first
        first.prev = block
        head.next = block
        block.queue = self
        self._len += 1

    def popleft(self) -> KVBlock:
        """Take the front block. The caller checks ``len`` first."""
        head = self._head
        block = head.next
        assert block is not None and block is not self._tail, f"{self.name}: pop from empty queue"
        nxt = block.next
        assert nxt is not None
        head.next = nxt
        nxt.prev = head
        block.prev = block.next = None
        block.queue = None
        self._len -= 1
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take the first ``n`` blocks in order (one splice instead of ``n`` unlinks)."""
        assert 0 <= n <= self._len, f"{self.name}: pop {n} of {self._len}"
        taken: list[KVBlock] = []
        head = self._head
        node = head.next
        for _ in range(n):
            assert node is not None
            taken.append(node)
            node.prev = None
            node.queue = None
            node = node.next
        assert node is not None
        head.next = node
        node.prev = head
        for block in taken:
            block.next = None
        self._len -= n
        return taken

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from anywhere in the queue (a prefix hit on a free block)."""
        assert block.queue is self, f"block {block.block_id} is not in {self.name}"
        prev = block.prev
        nxt = block.next
        assert prev is not None and nxt is not None
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        block.queue = None
        self._len -= 1

    def check(self) -> list[KVBlock]:
        """Walk the links both ways; raise on any inconsistency; return the blocks in order."""
        blocks: list[KVBlock] = []
        seen: set[int] = set()
        prev = self._head
        node = self._head.next
        while node is not self._tail:
            if node is None:
                raise RuntimeError(f"{self.name}: next link of block {prev.block_id} is None")
            if node.prev is not prev:
                raise RuntimeError(
                    f"{self.name}: block {node.block_id}.prev is not block {prev.block_id}"
                )
            if node.queue is not self:
                raise RuntimeError(f"{self.name}: block {node.block_id} claims another queue")
            if id(node) in seen or len(blocks) > self._len:
                raise RuntimeError(f"{self.name}: cycle at block {node.block_id}")
            seen.add(id(node))
            blocks.append(node)
            prev = node
            node = node.next
        if self._tail.prev is not prev:
            raise RuntimeError(f"{self.name}: tail.prev is not the last block")
        if len(blocks) != self._len:
            raise RuntimeError(f"{self.name}: length {self._len} but {len(blocks)} blocks linked")
        return blocks
