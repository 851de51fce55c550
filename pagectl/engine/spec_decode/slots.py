"""The scheduler's side of the draft-model method: it reserves proposal slots, the runner's
draft model fills them (``draft_model.py``)."""

from __future__ import annotations

# Stands for a proposal the draft model has not made yet. ``SchedulerOutput.spec_token_ids``
# holds k of them for a sequence that speculates k tokens; the runner replaces them with
# the draft's tokens before the step's forward, so no model ever sees this id.
DRAFT_PLACEHOLDER = -1


class DraftSlots:
    """The draft-model method's proposer, as the scheduler calls it: always ``k`` slots
    (a model proposes at every position, unlike an n-gram lookup that may find nothing)."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * k if k > 0 else []
