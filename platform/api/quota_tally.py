"""The running tally the quota checks read: each tenant's training and sampling tokens of the UTC day, and its
sampling tokens of the current minute. Pure bookkeeping (no I/O, no clock): quota_checks.py decides, ledger_watch.py
feeds it the ledgers.

Why it is built this way. The durable truth is the metering ledgers (workflows/usage.py): what the JAX worker
counted, recorded once by the workflow that accepted each answer. But an op is checked when it arrives, before the
worker has counted anything, and reading the ledgers on every op would cost a Temporal visibility listing and a query
per run. So the API keeps a tally per tenant and day that is the ledger as last read plus what this process accepted
that the ledger does not show yet:

- training: an op is charged at acceptance what it will be metered (the input tokens of its datums, counted off the
  protobuf body) and is pending until metered. It is charged once per (run, seq_id): the SDK sends a request again
  with the same seq_id after a connection error, Temporal answers the resend with the first update (its id is the
  seq_id and body hash, training_ops.submit) and the workflow meters the op once, so the tally remembers the ops it
  charged on the days it keeps and charges a resend nothing. Ops carry no id into the ledger, so pending tokens are
  settled in aggregate: what the ledger gains is taken off them (never below 0). With one API process that is exact
  whatever the order of reads and answers, since every op is charged before it can be metered; with replicas each
  sees the others' work once it is metered, and may miss as much of its own pending work as theirs finished
  meanwhile (a resend that reaches another replica is charged there too, and settled there the same way). An op
  that fails in the engine is never metered and stays pending: the tally errs high by it.
- sampling: a call reserves at acceptance the most it can use, its prompt plus num_samples x max_tokens (the meter
  counts a request's prompt once, however many samples share it, so the reservation does too). The reservation is
  bound to the SampleRequest workflow that carries the call and dropped when the ledger read shows that workflow
  closed: from then on its metered usage (the tokens actually sampled) is in `metered` instead.
- the rate limit counts reservations in fixed one-minute windows, as hosted services count max_tokens against their
  tokens-per-minute limits; nothing is given back when fewer are sampled.

At start the tally is seeded from the ledgers of the day (ledger_watch.py's first read) before the API serves, so a
restart neither forgets the day's usage nor counts it twice. Days before yesterday are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinkerflow.workflows.protocol.usage import OpUsage


@dataclass
class _Day:
    metered_training: int = 0  # the ledger as last read
    metered_sampling: int = 0
    pending_training: int = 0  # charged here, less what the ledger gained since
    reserved_sampling: int = 0  # sample calls whose batch the ledger has not shown closed yet
    charged_ops: set[tuple[str, int]] = field(default_factory=set[tuple[str, int]])  # (run, seq_id) charged here

    @property
    def training(self) -> int:
        return self.metered_training + self.pending_training

    @property
    def sampling(self) -> int:
        return self.metered_sampling + self.reserved_sampling


@dataclass(frozen=True)
class Charge:
    """What one accepted op or call was charged: handed back when it could not be submitted after all."""

    tenant: str
    day: str  # YYYY-MM-DD (UTC)
    tokens: int
    minute: int = -1  # the rate window it was counted in (sampling)
    op: tuple[str, int] | None = None  # the training op's (run, seq_id)


@dataclass
class UsageTally:
    _days: dict[tuple[str, str], _Day] = field(default_factory=dict[tuple[str, str], _Day])
    _windows: dict[str, tuple[int, int]] = field(default_factory=dict[str, tuple[int, int]])  # tenant -> minute, used
    _bound: dict[str, list[Charge]] = field(default_factory=dict[str, list[Charge]])  # workflow id -> its calls
    # The batches the last two reads found closed: a call's caller binds its reservation moments after its batch
    # started, so one read is the most that can come between.
    _closed: tuple[set[str], set[str]] = field(default_factory=lambda: (set[str](), set[str]()))

    def _day(self, tenant: str, day: str) -> _Day:
        return self._days.setdefault((tenant, day), _Day())

    def training(self, tenant: str, day: str) -> int:
        d = self._days.get((tenant, day))
        return d.training if d else 0

    def sampling(self, tenant: str, day: str) -> int:
        d = self._days.get((tenant, day))
        return d.sampling if d else 0

    def this_minute(self, tenant: str, minute: int) -> int:
        at, used = self._windows.get(tenant, (minute, 0))
        return used if at == minute else 0

    def charged(self, tenant: str, op: tuple[str, int]) -> bool:
        """Whether the training op `op` (run, seq_id) was charged on a day still kept (a resend may cross midnight)."""
        return any(t == tenant and op in d.charged_ops for (t, _), d in self._days.items())

    def charge_training(self, tenant: str, day: str, tokens: int, op: tuple[str, int]) -> Charge:
        d = self._day(tenant, day)
        d.pending_training += tokens
        d.charged_ops.add(op)
        return Charge(tenant, day, tokens, op=op)

    def refund_training(self, charge: Charge) -> None:
        d = self._day(charge.tenant, charge.day)
        d.pending_training = max(0, d.pending_training - charge.tokens)
        if charge.op is not None:  # never accepted: a resend is charged as the first
            d.charged_ops.discard(charge.op)

    def reserve_sampling(self, tenant: str, day: str, minute: int, tokens: int) -> Charge:
        self._day(tenant, day).reserved_sampling += tokens
        self._windows[tenant] = (minute, self.this_minute(tenant, minute) + tokens)
        return Charge(tenant, day, tokens, minute)

    def release_sampling(self, charge: Charge) -> None:
        """A reservation whose call was never submitted: out of the day and, within its minute, out of the window."""
        d = self._day(charge.tenant, charge.day)
        d.reserved_sampling = max(0, d.reserved_sampling - charge.tokens)
        at, used = self._windows.get(charge.tenant, (-1, 0))
        if at == charge.minute:
            self._windows[charge.tenant] = (at, max(0, used - charge.tokens))

    def bind(self, charge: Charge, workflow_id: str) -> None:
        """The reservation's call is carried by this SampleRequest workflow: settled when the ledger shows it closed."""
        if any(workflow_id in read for read in self._closed):  # read closed before its caller came back
            self._settle(charge)
        else:
            self._bound.setdefault(workflow_id, []).append(charge)

    def metered(self, tenant: str, hour: str, usage: OpUsage, *, seeding: bool) -> None:
        """The ledger grew by `usage` in `hour` (workflows/usage.py hour_of). `seeding`: the first read, which finds
        the day's usage so far rather than what grew while this process watched."""
        d = self._day(tenant, hour[:10])
        d.metered_training += usage.training_tokens
        d.metered_sampling += usage.prefill_tokens + usage.sampled_tokens
        if not seeding:
            d.pending_training = max(0, d.pending_training - usage.training_tokens)

    def closed(self, workflow_ids: set[str]) -> None:
        """These SampleRequest workflows were read closed: their usage is metered, their reservations end."""
        self._closed = (self._closed[1], set(workflow_ids))
        for wf in workflow_ids:
            for charge in self._bound.pop(wf, []):
                self._settle(charge)

    def _settle(self, charge: Charge) -> None:
        d = self._day(charge.tenant, charge.day)
        d.reserved_sampling = max(0, d.reserved_sampling - charge.tokens)

    def prune(self, yesterday: str) -> None:
        """Forget days before yesterday (an op accepted at 23:59 may be metered after midnight)."""
        self._days = {k: v for k, v in self._days.items() if k[1] >= yesterday}
        self._bound = {k: [c for c in v if c.day >= yesterday] for k, v in self._bound.items()}
        self._bound = {k: v for k, v in self._bound.items() if v}
