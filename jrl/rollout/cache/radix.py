"""RadixCache: a prefix tree over full KV pages of token ids, one tree per weight version.

Each node is one page: its key is the `page_size` token ids it holds, its value the page
id whose KV was computed for exactly that prefix. A lookup walks the tree page by page and
returns the pages of the longest cached prefix; the caller shares them (reference counts
in the allocator), so identical prefixes are computed once. Trees are keyed by the weight
version that computed their KV: a lookup only sees its own version's tree, and
`drop_versions_except` removes the others after a weight update.

Unreferenced pages sit in the allocator's LRU; when the allocator evicts one, the tree
drops that node and everything below it (pages below a node are never more recently used
than the node, because a request holds every page of its path).

Each tree indexes its own nodes by page, and a node names its parent by page id rather
than by reference (no reference cycles): dropping a version is then one bulk `uncache`
of its pages and its tree freed by reference counting, not a Python walk over its nodes.
After a GRPO generate a tree holds thousands of pages, and that walk was most of
`Engine.update_weights`' host time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jrl.rollout.cache.page_pool import Allocator

_ROOT = -1  # the parent page of a first-page node


class _Node:
    __slots__ = ("key", "page", "parent", "children")

    def __init__(self, key: bytes, page: int, parent: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent  # the parent node's page (_ROOT for the tree's root)
        self.children: dict[bytes, _Node] = {}


class _Tree:
    """One version's prefix tree and its nodes by page."""

    __slots__ = ("root", "nodes")

    def __init__(self) -> None:
        self.root = _Node(b"", _ROOT, _ROOT)
        self.nodes: dict[int, _Node] = {}


class RadixCache:
    def __init__(self, page_size: int, allocator: Allocator) -> None:
        self.page_size = page_size
        self.allocator = allocator
        allocator.on_evict = self._evict_page
        self._trees: dict[int, _Tree] = {}

    @property
    def n_cached_pages(self) -> int:
        return sum(len(t.nodes) for t in self._trees.values())

    @property
    def versions(self) -> list[int]:
        return sorted(v for v, t in self._trees.items() if t.nodes)

    def version_of_page(self, page: int) -> int | None:
        return next((v for v, t in self._trees.items() if page in t.nodes), None)

    def _keys(self, tokens: Sequence[int], n_pages: int) -> list[bytes]:
        """Keys of the first `n_pages` pages of `tokens`: each page's ids as int32 bytes,
        one object per key (a tuple costs an int object per token to build and to free)."""
        width = 4 * self.page_size
        flat = np.asarray(tokens[:n_pages * self.page_size], np.int32).tobytes()
        return [flat[i * width:(i + 1) * width] for i in range(n_pages)]

    def match(self, tokens: Sequence[int], version: int, max_tokens: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (at most `max_tokens` tokens,
        whole pages only) computed under `version`. The caller must `share` them."""
        tree = self._trees.get(version)
        pages: list[int] = []
        if tree is None:
            return pages
        node = tree.root
        for key in self._keys(tokens, max(0, max_tokens) // self.page_size):
            node = node.children.get(key)
            if node is None:
                break
            pages.append(node.page)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], version: int) -> int:
        """Publishes `pages` (each full, holding the KV of consecutive `page_size` tokens of
        `tokens`, computed under `version`). Where the tree already has a node for a prefix,
        the existing page stays and the caller's page remains private. Returns the number
        of pages newly cached."""
        tree = self._trees.get(version)
        if tree is None:
            tree = self._trees[version] = _Tree()
        node = tree.root
        added = 0
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            child = node.children.get(key)
            if child is None:
                # Already cached under another prefix: keep private. Dirty (a request that
                # shared it failed with non-finite logits): never cached again.
                if self.allocator.cached[page] or self.allocator.dirty[page]:
                    break
                child = _Node(key, page, node.page)
                node.children[key] = child
                tree.nodes[page] = child
                self.allocator.mark_cached(page)
                added += 1
            node = child
        return added

    def _remove_subtree(self, tree: _Tree, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            del tree.nodes[n.page]
            self.allocator.uncache(n.page)
        parent = tree.root if node.parent == _ROOT else tree.nodes[node.parent]
        del parent.children[node.key]

    def _evict_page(self, page: int) -> None:
        for tree in self._trees.values():
            node = tree.nodes.get(page)
            if node is not None:
                self._remove_subtree(tree, node)
                return
        raise KeyError(f"page {page}: evicted but in no prefix tree")

    def reset(self) -> None:
        """Forgets every entry without telling the allocator (which the caller resets too:
        `TaskCacheManager.reset`)."""
        self._trees = {}

    def drop_pages(self, pages: Sequence[int]) -> int:
        """Removes `pages` from every tree, with everything cached below them (their KV
        was computed attending to these pages). Pages still referenced by a request leave
        the cache and are freed when released. Returns the number of nodes removed."""
        before = self.n_cached_pages
        for page in pages:
            for tree in self._trees.values():
                node = tree.nodes.get(page)
                if node is not None:
                    self._remove_subtree(tree, node)
                    break
        return before - self.n_cached_pages

    def drop_versions_except(self, version: int) -> int:
        """Removes every entry computed under another version (pages still referenced by a
        request leave the cache and are freed when released). Returns pages dropped."""
        dropped = 0
        for v in [v for v in self._trees if v != version]:
            pages = self._trees.pop(v).nodes
            self.allocator.uncache_many(pages)
            dropped += len(pages)
        return dropped
