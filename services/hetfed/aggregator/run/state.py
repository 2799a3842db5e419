"""A run's state as a value, and its transitions as pure functions.

``RunState`` is frozen: who joined and declared, the tensor schema, the label count and input shape, the open
round and who pushed in it, and who was refused for good. Each transition (``join``, ``accept``, ``close``,
``refuse``) takes a state and returns a ``Step``: the next state and the effects the engine must carry out
(persist a checkpoint, fold an update into the server half, aggregate a round). Nothing here does I/O, reads a
clock or takes a lock; the conductor (``hetfed.aggregator.run.conductor.Run``) does, and observers (metrics, Events) watch
the effects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hetfed.wire import contract
from hetfed.wire.errors import LEAVE_REASONS, WireError, clip
from hetfed.wire.phases import Phase


@dataclass(frozen=True)
class Rules:
    """What a run's config fixes for its whole life: the members, rounds, quorum and first phase."""

    run_id: str
    organizations: tuple[str, ...]
    rounds: int
    quorum: int
    shared_schema: bool
    first_phase: Phase
    state_dir: str = ""


@dataclass(frozen=True)
class Refused:
    """A member refused for a reason no retry can fix. ``at_push``: its own admitted client was refused while
    pushing in ``round`` (a hetfed client then exits): rounds after that one stop waiting for it, and that one too
    when the push was a leave notice (``privacy_budget_spent``, ``organization_left``), until it joins again or an
    update of its is accepted. A refusal at Join of an admitted member leaves its admission standing."""

    reason: str
    message: str
    at_push: bool = False
    round: int = -1


@dataclass(frozen=True)
class DataShape:
    """What an organization's model and data are built for: the label count and the shape of one input (0 and
    (): not declared, not checked)."""

    num_classes: int = 0
    input_shape: tuple[int, ...] = ()

    @property
    def declared(self) -> bool:
        """Whether it declares anything."""
        return bool(self.num_classes or self.input_shape)

    def conflicts(self, other: DataShape) -> bool:
        """Whether a value both declare differs."""
        return bool((self.num_classes and other.num_classes and self.num_classes != other.num_classes)
                    or (self.input_shape and other.input_shape and self.input_shape != other.input_shape))

    def __str__(self) -> str:
        parts = [f"{self.num_classes} classes"] if self.num_classes else []
        if self.input_shape:
            parts.append(f"inputs ({', '.join(map(str, self.input_shape))})")
        return " and ".join(parts) or "no declared data"

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's form."""
        return {"num_classes": self.num_classes, "input_shape": list(self.input_shape)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DataShape:
        """Inverse of ``to_json``."""
        return cls(int(d["num_classes"]), tuple(int(s) for s in d["input_shape"]))


@dataclass(frozen=True)
class RunState:
    """Everything a run's rounds depend on; the checkpoint persists it (``to_json``)."""

    phase: Phase
    round: int
    closed: int = 0  # rounds closed so far
    schema: contract.Schema = field(default_factory=dict)
    joined: frozenset[str] = frozenset()
    declared: frozenset[str] = frozenset()  # whose tensor declaration matched the schema
    examples: Mapping[str, int] = field(default_factory=dict)  # training examples declared at Join
    pushed: Mapping[str, bytes] = field(default_factory=dict)  # SHA-256 of each accepted update this round
    refused: Mapping[str, Refused] = field(default_factory=dict)
    # The label count and input shape the first organization to declare them fixed for the run, and who it was.
    data: DataShape = DataShape()
    data_from: str = ""

    @classmethod
    def start(cls, rules: Rules) -> RunState:
        """A new run: round 0 when it has a setup phase, else round 1."""
        return cls(rules.first_phase, 0 if rules.first_phase is Phase.SETUP else 1)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's form (``pushed`` is not in it: the write-ahead log holds the open round)."""
        return {
            "phase": self.phase.value, "round": self.round,
            "schema": contract.schema_to_json(self.schema), "joined": sorted(self.joined),
            "declared": sorted(self.declared), "examples": dict(sorted(self.examples.items())),
            "refused": {o: [r.reason, r.message, r.at_push, r.round] for o, r in sorted(self.refused.items())},
            "data": {**self.data.to_json(), "organization": self.data_from} if self.data.declared else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], rules: Rules, closed: int) -> RunState:
        """Inverse of ``to_json`` (``closed``: the committed history's length); refusals of organizations no
        longer in the run are dropped."""
        return cls(
            phase=Phase(d["phase"]), round=int(d["round"]), closed=closed,
            schema=contract.schema_from_json(d["schema"]), joined=frozenset(d["joined"]),
            declared=frozenset(d.get("declared", d["joined"])),
            examples={str(k): int(v) for k, v in d.get("examples", {}).items()},
            refused={str(o): Refused(str(v[0]), str(v[1]), *((bool(v[2]), int(v[3])) if len(v) > 3 else ()))
                     for o, v in d.get("refused", {}).items() if o in rules.organizations},
            data=DataShape.from_json(d["data"]) if d.get("data") else DataShape(),
            data_from=str(d["data"]["organization"]) if d.get("data") else "",
        )

    def admitted(self, org: str, rules: Rules) -> bool:
        """Joined, and declared its tensors when the run shares a schema."""
        return org in self.joined and (not rules.shared_schema or org in self.declared)

    def given_up(self, org: str, rules: Rules) -> bool:
        """Refused for good and no longer expected: never admitted, or its own client refused at a push in an
        earlier round, or in this one when the push was its leave notice (``LEAVE_REASONS``: it sent its
        last update already, so the open round need not wait for it either)."""
        r = self.refused.get(org)
        if r is None:
            return False
        if not self.admitted(org, rules):
            return True
        left = r.reason in LEAVE_REASONS
        return r.at_push and (self.round > r.round or (left and self.round == r.round))


# ------------------------------------------------------------------------------------------------ effects
@dataclass(frozen=True)
class Persist:
    """Write the new state's checkpoint before the state takes effect (a join, a refusal)."""


@dataclass(frozen=True)
class Fold:
    """Fold the organization's checked update into the server half."""

    organization: str


@dataclass(frozen=True)
class Duplicate:
    """The same update again: acknowledge it, change nothing."""

    organization: str


@dataclass(frozen=True)
class Close:
    """Aggregate the round that ``phase``/``round`` name; the next state is already in the step."""

    phase: Phase
    round: int


@dataclass(frozen=True)
class RefusalChanged:
    """A member's refusal was recorded (``refused``) or lifted (``None``); ``old`` is what it replaced."""

    organization: str
    refused: Refused | None
    old: Refused | None


@dataclass(frozen=True)
class Stranger:
    """A non-member was refused (listed in Status, never in metrics)."""

    organization: str
    reason: str
    message: str


Effect = Persist | Fold | Duplicate | Close | RefusalChanged | Stranger


@dataclass(frozen=True)
class Step:
    """A transition's result: the next state and what to do about it, in order."""

    state: RunState
    effects: tuple[Effect, ...] = ()


# ------------------------------------------------------------------------------------------------ transitions
def check_member(state: RunState, rules: Rules, org: str) -> None:
    """WireError unless ``org`` is a member that joined (and declared, when the run shares a schema)."""
    if org not in rules.organizations:
        raise WireError("unknown_organization", f"organization {clip(org, 64)!r} is not part of run {rules.run_id!r}")
    if org not in state.joined:
        raise WireError("not_joined", f"organization {org!r} must Join run {rules.run_id!r} first")
    if rules.shared_schema and org not in state.declared:
        raise WireError("not_declared", f"organization {org!r} must declare its tensors: join run {rules.run_id!r} "
                                        "again with declared_tensors")


def check_round(state: RunState, rules: Rules, round_: int) -> None:
    """WireError ``late`` unless ``round_`` is the open round."""
    if state.phase is Phase.FINISHED:
        raise WireError("late", f"run {rules.run_id!r} has finished; round {round_} is closed")
    if round_ != state.round:
        where = "is closed" if round_ < state.round else "has not started"
        raise WireError("late", f"round {round_} {where}; the current round is {state.round} ({state.phase.value})")


def check_data(state: RunState, rules: Rules, org: str, data: DataShape) -> None:
    """WireError ``data_mismatch`` when ``data`` declares a label count or input shape other than the run's."""
    if state.data.conflicts(data):
        raise WireError("data_mismatch", f"organization {org!r} has {data}; run {rules.run_id!r} has {state.data} "
                                         f"from {state.data_from!r}")


def join(state: RunState, rules: Rules, org: str, declared: contract.Schema | None, examples: int,
         data: DataShape = DataShape()) -> Step:
    """Admit a member. ``declared``: the schema its declaration gives (None when it declares nothing); the first
    one fixes the run's schema, later ones must equal it. ``data``: the label count and input shape it declares;
    the first declaration fixes the run's, later ones must agree where both declare a value. Persist when anything
    durable changed."""
    if org not in rules.organizations:
        raise WireError("unknown_organization", f"organization {clip(org, 64)!r} is not part of run {rules.run_id!r}")
    if state.phase is Phase.FINISHED:
        raise WireError("run_finished", f"run {rules.run_id!r} finished after {state.closed} rounds (its state is in "
                                        f"{rules.state_dir}); to train again give the run a new id, or remove its "
                                        "state to start it over")
    check_data(state, rules, org, data)
    schema = state.schema
    if declared is not None:
        if schema:
            contract.check_same_schema(schema, declared)
        else:
            schema = declared
    new = replace(
        state, schema=schema, joined=state.joined | {org},
        declared=state.declared | {org} if declared is not None else state.declared,
        examples={**state.examples, org: examples} if examples else state.examples,
    )
    if data.declared and not state.data.declared:
        new = replace(new, data=data, data_from=org)
    old = state.refused.get(org)
    if old is not None:
        new = replace(new, refused={o: r for o, r in state.refused.items() if o != org})
    effects: list[Effect] = []
    if (new.schema, new.joined, new.declared, new.examples, new.refused, new.data) != \
            (state.schema, state.joined, state.declared, state.examples, state.refused, state.data):
        effects.append(Persist())
    if old is not None:
        effects.append(RefusalChanged(org, None, old))
    return Step(new, tuple(effects))


def is_duplicate(state: RunState, rules: Rules, org: str, round_: int, digest: bytes) -> bool:
    """Whether this update was accepted already (the same digest); ``late`` for another round, ``replayed`` for
    a different update of the same round. Builds no state: pushes ask it before and after their slow steps."""
    check_round(state, rules, round_)
    held = state.pushed.get(org)
    if held is not None and held != digest:
        raise WireError("replayed", f"organization {org!r} already pushed a different update for round {state.round}")
    return held is not None


def seen(state: RunState, rules: Rules, org: str, round_: int, digest: bytes) -> Step:
    """An update that may have been accepted already: a ``Duplicate`` effect when it was, no effect when it was
    not (``late`` or ``replayed`` as ``is_duplicate`` says); the state does not change."""
    return Step(state, (Duplicate(org),) if is_duplicate(state, rules, org, round_, digest) else ())


def accept(state: RunState, rules: Rules, org: str, round_: int, digest: bytes) -> Step:
    """A member's update for the open round: fold it, acknowledge a duplicate, or refuse a different replay. An
    accepted update lifts a refusal at a push (the next checkpoint records it)."""
    if is_duplicate(state, rules, org, round_, digest):
        return Step(state, (Duplicate(org),))
    new = replace(state, pushed={**state.pushed, org: digest})
    old = state.refused.get(org)
    if old is None or not old.at_push:
        return Step(new, (Fold(org),))
    return Step(replace(new, refused={o: r for o, r in state.refused.items() if o != org}),
                (Fold(org), RefusalChanged(org, None, old)))


def due(state: RunState, rules: Rules, overdue: bool) -> bool:
    """Whether the open round closes now: everyone still expected pushed, or its deadline passed (``overdue``)
    with at least the quorum."""
    if state.phase is Phase.FINISHED or not state.pushed:
        return False
    everyone = all(o in state.pushed or state.given_up(o, rules) for o in rules.organizations)
    return everyone or (overdue and len(state.pushed) >= rules.quorum)


def next_round(phase: Phase, round_: int, rounds: int) -> tuple[Phase, int]:
    """The phase and round after ``round_``: setup, train 1..R, evaluate R+1, finished."""
    if phase is Phase.SETUP:
        return Phase.TRAIN, 1
    if phase is Phase.TRAIN:
        return (Phase.TRAIN, round_ + 1) if round_ < rounds else (Phase.EVALUATE, round_ + 1)
    return Phase.FINISHED, round_


def close(state: RunState, rules: Rules) -> Step:
    """Close the open round: the next round opens with nobody pushed."""
    phase, round_ = next_round(state.phase, state.round, rules.rounds)
    return Step(replace(state, phase=phase, round=round_, closed=state.closed + 1, pushed={}),
                (Close(state.phase, state.round),))


def refuse(state: RunState, rules: Rules, org: str, reason: str, message: str, at_push: bool) -> Step:
    """Record a refusal no retry can fix. A member's is kept (Persist when its reason or kind changed); a
    non-member's only listed."""
    if org not in rules.organizations:
        return Step(state, (Stranger(clip(org, 64), reason, message),))
    entry = Refused(reason, message, at_push, state.round if at_push else -1)
    old = state.refused.get(org)
    if old == entry:
        return Step(state)
    new = replace(state, refused={**state.refused, org: entry})
    durable = old is None or (old.reason, old.at_push) != (reason, at_push)
    return Step(new, ((Persist(),) if durable else ()) + (RefusalChanged(org, entry, old),))
