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
"""

from __future__ import annotations

from collections.abc import Sequence

from jrl.rollout.cache.page_pool import Allocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "version")

    def __init__(self, key: tuple[int, ...], page: int, parent: "_Node | None", version: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.version = version


class RadixCache:
    def __init__(self, page_size: int, allocator: Allocator) -> None:
        self.page_size = page_size
        self.allocator = allocator
        allocator.on_evict = self._evict_page
        self._roots: dict[int, _Node] = {}
        self._by_page: dict[int, _Node] = {}

    @property
    def n_cached_pages(self) -> int:
        return len(self._by_page)

    @property
    def versions(self) -> list[int]:
        return sorted(v for v, r in self._roots.items() if r.children)

    def version_of_page(self, page: int) -> int | None:
        node = self._by_page.get(page)
        return None if node is None else node.version

    def _keys(self, tokens: Sequence[int], n_pages: int):
        p = self.page_size
        for i in range(n_pages):
            yield tuple(int(t) for t in tokens[i * p:(i + 1) * p])

    def match(self, tokens: Sequence[int], version: int, max_tokens: int) -> list[int]:
        """Pages of the longest cached prefix of `tokens` (at most `max_tokens` tokens,
        whole pages only) computed under `version`. The caller must `share` them."""
        node = self._roots.get(version)
        pages: list[int] = []
        if node is None:
            return pages
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
        node = self._roots.setdefault(version, _Node((), -1, None, version))
        added = 0
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            child = node.children.get(key)
            if child is None:
                if page in self._by_page:  # already cached under another prefix: keep private
                    break
                child = _Node(key, page, node, version)
                node.children[key] = child
                self._by_page[page] = child
                self.allocator.mark_cached(page)
                added += 1
            node = child
        return added

    def _remove_subtree(self, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}
            del self._by_page[n.page]
            self.allocator.uncache(n.page)
        if node.parent is not None:
            del node.parent.children[node.key]
            node.parent = None

    def _evict_page(self, page: int) -> None:
        self._remove_subtree(self._by_page[page])

    def drop_versions_except(self, version: int) -> int:
        """Removes every entry computed under another version (pages still referenced by a
        request leave the cache and are freed when released). Returns pages dropped."""
        dropped = 0
        for v in [v for v in self._roots if v != version]:
            root = self._roots.pop(v)
            for child in list(root.children.values()):
                before = len(self._by_page)
                self._remove_subtree(child)
                dropped += before - len(self._by_page)
        return dropped
