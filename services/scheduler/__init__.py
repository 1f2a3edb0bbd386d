"""The scheduler: decides every step which requests run and how many tokens each
advances (pure Python; never imports torch)."""

from weir.services.scheduler.kv_cache_manager import KVCacheManager
from weir.services.scheduler.request import FINISH_REASONS, Request, RequestStatus
from weir.services.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = [
    "FINISH_REASONS",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerStats",
]
