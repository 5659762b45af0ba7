"""The answers a JAX worker process gave, remembered by item key: a batch Temporal retries after a transient failure
does not re-apply work this process already did, and the coordinator reads only what it needs of an answer its
requester already has."""

from __future__ import annotations

from collections import OrderedDict

from tinkerflow.workflows.protocol.messages import Outcome, WorkResult

REMEMBERED_ANSWERS = 4096


class Answers:
    """The last REMEMBERED_ANSWERS outcomes by item key, and which of them reached their requester straight."""

    def __init__(self) -> None:
        self._outcomes: OrderedDict[str, Outcome] = OrderedDict()
        self._delivered: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self._outcomes

    def __getitem__(self, key: str) -> Outcome:
        return self._outcomes[key]

    def remember(self, key: str, outcome: Outcome) -> None:
        self._outcomes[key] = outcome
        while len(self._outcomes) > REMEMBERED_ANSWERS:
            old, _ = self._outcomes.popitem(last=False)
            self._delivered.discard(old)

    def delivered(self, key: str) -> None:
        """The requester confirmed it has this answer: the coordinator need not deliver it again."""
        self._delivered.add(key)

    def for_coordinator(self, key: str, outcome: Outcome) -> WorkResult:
        """What the coordinator reads of an answer its requester has: whether it failed; all of one it has not."""
        if key not in self._delivered:
            return WorkResult(key=key, outcome=outcome)
        slim = Outcome(error=outcome.error, category=outcome.category, worker_lost=outcome.worker_lost)
        return WorkResult(key=key, outcome=slim, delivered=True)
