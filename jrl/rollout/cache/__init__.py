"""Host-side KV cache structures (pages, rows, prefix tree) and the device KV buffers."""

from jrl.rollout.cache.kv_storage import KVStorage, kv_shapes
from jrl.rollout.cache.page_pool import Allocator, OutOfPages, PagePool
from jrl.rollout.cache.radix import RadixCache
from jrl.rollout.cache.req_to_token import ReqToTokenPool
from jrl.rollout.cache.task_cache import BoundBatch, TaskCache, TaskCacheManager

__all__ = ["Allocator", "BoundBatch", "KVStorage", "OutOfPages", "PagePool", "RadixCache",
           "ReqToTokenPool", "TaskCache", "TaskCacheManager", "kv_shapes"]
