"""The waiting queue: FCFS (a deque) or priority (a heap), with lazy removal."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagectl.engine.request import Request


class WaitingQueue:
    """Waiting sequences in service order. Removal is lazy: finished entries are skipped."""

    def __init__(self, policy: str) -> None:
        self._by_priority = policy == "priority"
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, req: Request) -> None:
        if self._by_priority:
            heapq.heappush(self._heap, (req.priority_key, req))
        else:
            self._fifo.append(req)
        self._live += 1

    def push_front(self, req: Request) -> None:
        """Put a preempted sequence back where it is served next (priority: its own key)."""
        if self._by_priority:
            self.push(req)
        else:
            self._fifo.appendleft(req)
            self._live += 1

    def discard(self, req: Request) -> None:
        """Forget ``req`` (already marked finished); its entry is skipped later."""
        self._live -= 1

    def peek(self) -> Request | None:
        if self._by_priority:
            heap = self._heap
            while heap and heap[0][1].status.finished:
                heapq.heappop(heap)
            return heap[0][1] if heap else None
        fifo = self._fifo
        while fifo and fifo[0].status.finished:
            fifo.popleft()
        return fifo[0] if fifo else None

    def pop(self) -> Request:
        req = self.peek()
        assert req is not None
        if self._by_priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self._live -= 1
        return req

    def __iter__(self) -> Iterator[Request]:
        if self._by_priority:
            items = [r for _, r in sorted(self._heap, key=lambda e: e[0])]
        else:
            items = list(self._fifo)
        return (r for r in items if not r.status.finished)
