"""The run's pure transitions on tiny states: exact next states and effects, no I/O, no clock, no lock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetfed.aggregator.run.state import (
    Close,
    DataShape,
    Duplicate,
    Fold,
    Persist,
    RefusalChanged,
    Refused,
    Rules,
    RunState,
    Step,
    Stranger,
    accept,
    close,
    due,
    join,
    next_round,
    refuse,
)
from hetfed.wire.contract import TensorDecl
from hetfed.wire.errors import LEAVE_REASONS, ORGANIZATION_LEFT_REASON, PRIVACY_BUDGET_SPENT_REASON, WireError
from hetfed.wire.payloads import PayloadKind
from hetfed.wire.phases import Phase

RULES = Rules("r", ("a", "b", "c"), rounds=2, quorum=2, shared_schema=True, first_phase=Phase.TRAIN,
                 state_dir="/state/r")
SCHEMA = {PayloadKind.MODEL_WEIGHTS: {"w": TensorDecl("float32", (3,))}}
OTHER = {PayloadKind.MODEL_WEIGHTS: {"w": TensorDecl("float32", (4,))}}


def joined(*orgs: str, **kw: object) -> RunState:
    return RunState(Phase.TRAIN, 1, schema=SCHEMA, joined=frozenset(orgs), declared=frozenset(orgs), **kw)  # type: ignore[arg-type]


def test_a_new_run_starts_at_round_one_or_at_its_setup_round() -> None:
    assert RunState.start(RULES) == RunState(Phase.TRAIN, 1)
    setup = Rules("r", ("a",), 1, 1, False, Phase.SETUP)
    assert RunState.start(setup) == RunState(Phase.SETUP, 0)


def test_the_first_declaration_fixes_the_schema_and_is_persisted() -> None:
    step = join(RunState.start(RULES), RULES, "a", SCHEMA, 120)
    assert step == Step(RunState(Phase.TRAIN, 1, schema=SCHEMA, joined=frozenset("a"), declared=frozenset("a"),
                                 examples={"a": 120}), (Persist(),))


def test_joining_again_unchanged_persists_nothing() -> None:
    state = joined("a", examples={"a": 120})
    assert join(state, RULES, "a", SCHEMA, 120) == Step(state)


def test_a_different_declaration_is_refused_and_changes_nothing() -> None:
    with pytest.raises(WireError) as err:
        join(joined("a"), RULES, "b", OTHER, 0)
    assert err.value.reason == "schema_mismatch"


def test_a_stranger_and_a_finished_run_are_refused_at_join() -> None:
    with pytest.raises(WireError, match="organization 'z' is not part of run 'r'"):
        join(joined("a"), RULES, "z", SCHEMA, 0)
    finished = RunState(Phase.FINISHED, 4, closed=3)
    with pytest.raises(WireError) as err:
        join(finished, RULES, "a", SCHEMA, 0)
    assert err.value.reason == "run_finished"
    assert err.value.message.startswith("run 'r' finished after 3 rounds (its state is in /state/r)")


def test_accept_folds_once_then_acknowledges_the_same_bytes_and_refuses_others() -> None:
    state = joined("a", "b")
    step = accept(state, RULES, "a", 1, b"d1")
    assert step == Step(joined("a", "b", pushed={"a": b"d1"}), (Fold("a"),))
    assert accept(step.state, RULES, "a", 1, b"d1") == Step(step.state, (Duplicate("a"),))
    with pytest.raises(WireError) as err:
        accept(step.state, RULES, "a", 1, b"d2")
    assert err.value.reason == "replayed"


@pytest.mark.parametrize(("round_", "says"), [(0, "round 0 is closed"), (2, "round 2 has not started")])
def test_a_push_for_another_round_is_late(round_: int, says: str) -> None:
    with pytest.raises(WireError, match=f"{says}; the current round is 1 \\(train\\)") as err:
        accept(joined("a"), RULES, "a", round_, b"d")
    assert err.value.reason == "late"


def test_a_round_is_due_when_everyone_pushed_or_overdue_with_a_quorum() -> None:
    one = joined("a", "b", "c", pushed={"a": b"1"})
    two = joined("a", "b", "c", pushed={"a": b"1", "b": b"2"})
    three = joined("a", "b", "c", pushed={"a": b"1", "b": b"2", "c": b"3"})
    assert [due(s, RULES, overdue=False) for s in (one, two, three)] == [False, False, True]
    assert [due(s, RULES, overdue=True) for s in (one, two, three)] == [False, True, True]
    assert not due(joined("a", "b", "c"), RULES, overdue=True)  # nobody pushed: never


def test_close_walks_setup_train_evaluate_finished() -> None:
    assert [next_round(p, r, 2) for p, r in [(Phase.SETUP, 0), (Phase.TRAIN, 1), (Phase.TRAIN, 2),
                                                (Phase.EVALUATE, 3), (Phase.FINISHED, 3)]] == [
        (Phase.TRAIN, 1), (Phase.TRAIN, 2), (Phase.EVALUATE, 3), (Phase.FINISHED, 3), (Phase.FINISHED, 3)]
    state = joined("a", "b", pushed={"a": b"1", "b": b"2"})
    assert close(state, RULES) == Step(RunState(Phase.TRAIN, 2, closed=1, schema=SCHEMA, joined=state.joined,
                                                   declared=state.declared), (Close(Phase.TRAIN, 1),))


def test_a_member_never_admitted_and_refused_no_longer_holds_the_round() -> None:
    state = joined("a", "b", pushed={"a": b"1", "b": b"2"})
    step = refuse(state, RULES, "c", "schema_mismatch", "w is (4,)", at_push=False)
    entry = Refused("schema_mismatch", "w is (4,)")
    assert step == Step(joined("a", "b", pushed=state.pushed, refused={"c": entry}),
                        (Persist(), RefusalChanged("c", entry, None)))
    assert not due(state, RULES, overdue=False) and due(step.state, RULES, overdue=False)
    # The same refusal again changes nothing; another message for the same reason is not persisted again.
    assert refuse(step.state, RULES, "c", "schema_mismatch", "w is (4,)", at_push=False) == Step(step.state)
    again = refuse(step.state, RULES, "c", "schema_mismatch", "w is (5,)", at_push=False)
    assert again.effects == (RefusalChanged("c", Refused("schema_mismatch", "w is (5,)"), entry),)


def test_an_admitted_member_refused_at_join_still_holds_the_round() -> None:
    state = joined("a", "b", "c", pushed={"a": b"1", "b": b"2"})
    step = refuse(state, RULES, "c", "schema_mismatch", "another model", at_push=False)
    assert not step.state.given_up("c", RULES) and not due(step.state, RULES, overdue=False)


def test_a_refusal_at_a_push_releases_the_rounds_after_it_until_the_member_returns() -> None:
    state = joined("a", "b", "c", pushed={"a": b"1"})
    step = refuse(state, RULES, "c", "non_finite", "w holds NaN", at_push=True)
    entry = Refused("non_finite", "w holds NaN", at_push=True, round=1)
    assert step.effects == (Persist(), RefusalChanged("c", entry, None))
    # Round 1: c may still push a good update, so the round waits for it.
    assert not step.state.given_up("c", RULES)
    pushed = accept(step.state, RULES, "b", 1, b"2").state
    assert not due(pushed, RULES, overdue=False)
    # Round 2 (closed on the deadline): c is no longer expected.
    nxt = close(pushed, RULES).state
    assert nxt.given_up("c", RULES)
    two = accept(accept(nxt, RULES, "a", 2, b"3").state, RULES, "b", 2, b"4").state
    assert due(two, RULES, overdue=False)
    # An accepted update of c lifts it (the next checkpoint records that).
    back = accept(nxt, RULES, "c", 2, b"5")
    assert back.effects == (Fold("c"), RefusalChanged("c", None, entry)) and back.state.refused == {}
    # So does joining again, persisted at once.
    rejoin = join(nxt, RULES, "c", SCHEMA, 0)
    assert rejoin.effects == (Persist(), RefusalChanged("c", None, entry)) and rejoin.state.refused == {}


@pytest.mark.parametrize("reason", [PRIVACY_BUDGET_SPENT_REASON, ORGANIZATION_LEFT_REASON])
def test_a_leave_notice_releases_its_own_round_too_and_survives_the_checkpoint(reason: str) -> None:
    """Refused at a push with privacy_budget_spent or organization_left (a leave notice), a member is given up in
    that very round: it sent its last update already. Every other reason at a push holds that round (above)."""
    assert {PRIVACY_BUDGET_SPENT_REASON, ORGANIZATION_LEFT_REASON} == LEAVE_REASONS
    state = joined("a", "b", "c", pushed={"a": b"1"})
    step = refuse(state, RULES, "c", reason, "leaves", at_push=True)
    entry = Refused(reason, "leaves", at_push=True, round=1)
    assert step.effects == (Persist(), RefusalChanged("c", entry, None))
    assert step.state.given_up("c", RULES) and not due(step.state, RULES, overdue=False)
    pushed = accept(step.state, RULES, "b", 1, b"2").state
    assert due(pushed, RULES, overdue=False)
    assert close(pushed, RULES).state.given_up("c", RULES)
    back = RunState.from_json(step.state.to_json(), RULES, closed=0)
    assert back.refused == {"c": entry} and back.given_up("c", RULES)
    # The same reason at Join (not at a push) releases nothing of an admitted member.
    at_join = refuse(state, RULES, "c", reason, "leaves", at_push=False).state
    assert not at_join.given_up("c", RULES)
    # A refusal at a push in a later round than the open one (none can be) does not release it early.
    assert not replace(state, refused={"c": replace(entry, round=2)}).given_up("c", RULES)


def test_a_strangers_refusal_is_only_listed() -> None:
    state = joined("a")
    assert refuse(state, RULES, "z" * 100, "unknown_organization", "no", at_push=False) == Step(
        state, (Stranger("z" * 52 + "… (+48 chars)", "unknown_organization", "no"),))


def test_the_state_survives_its_checkpoint_form() -> None:
    state = joined("a", "b", examples={"a": 3}, refused={"c": Refused("non_finite", "NaN", True, 1)},
                   pushed={"a": b"1"})
    back = RunState.from_json(state.to_json(), RULES, closed=0)
    assert back == joined("a", "b", examples={"a": 3}, refused={"c": Refused("non_finite", "NaN", True, 1)})
    # A refusal stored before refusals at a push were kept (two fields) reads as one at Join.
    old = {**state.to_json(), "refused": {"c": ["schema_mismatch", "x"], "gone": ["x", "y"]}}
    assert RunState.from_json(old, RULES, closed=0).refused == {"c": Refused("schema_mismatch", "x")}


MNIST, OTHER_DATA = DataShape(10, (1, 28, 28)), DataShape(5, (3, 64, 64))


def test_the_first_declared_data_fixes_the_run_and_the_same_again_changes_nothing() -> None:
    step = join(RunState.start(RULES), RULES, "a", None, 0, MNIST)
    assert step == Step(RunState(Phase.TRAIN, 1, joined=frozenset("a"), data=MNIST, data_from="a"), (Persist(),))
    assert join(step.state, RULES, "a", None, 0, MNIST) == Step(step.state)
    again = join(step.state, RULES, "b", None, 0, MNIST)
    assert again == Step(replace(step.state, joined=frozenset("ab")), (Persist(),))  # b joined; a fixed the data


def test_other_data_is_refused_naming_both_sides_and_changes_nothing() -> None:
    state = join(RunState.start(RULES), RULES, "a", None, 0, MNIST).state
    for org in ("b", "a"):  # the organization that fixed the data cannot change it either
        with pytest.raises(WireError) as err:
            join(state, RULES, org, None, 0, OTHER_DATA)
        assert (err.value.reason, err.value.status, err.value.retryable) == ("data_mismatch", "FAILED_PRECONDITION",
                                                                             False)
        assert err.value.message == (f"organization {org!r} has 5 classes and inputs (3, 64, 64); run 'r' has 10 "
                                     "classes and inputs (1, 28, 28) from 'a'")
    with pytest.raises(WireError, match=r"^data_mismatch: organization 'b' has 10 classes and inputs \(784\); "):
        join(state, RULES, "b", None, 0, DataShape(10, (784,)))


def test_undeclared_data_is_not_checked_and_fixes_nothing() -> None:
    start = RunState.start(RULES)
    old_client = join(start, RULES, "a", None, 0)
    assert old_client.state.data == DataShape() and old_client.state.data_from == ""
    state = join(old_client.state, RULES, "b", None, 0, MNIST).state
    assert (state.data, state.data_from) == (MNIST, "b")
    assert join(state, RULES, "a", None, 0) == Step(state)  # an older client again: accepted, unchecked
    # A value only one side declared is not compared.
    assert join(state, RULES, "c", None, 0, DataShape(10)).state.data == MNIST
    assert join(state, RULES, "c", None, 0, DataShape(0, (1, 28, 28))).state.data == MNIST
    with pytest.raises(WireError, match="has 7 classes; run 'r' has 10 classes and inputs"):
        join(state, RULES, "c", None, 0, DataShape(7))


def test_the_fixed_data_survives_the_checkpoint_form() -> None:
    state = join(RunState.start(RULES), RULES, "a", None, 0, MNIST).state
    assert state.to_json()["data"] == {"num_classes": 10, "input_shape": [1, 28, 28], "organization": "a"}
    assert RunState.from_json(state.to_json(), RULES, closed=0) == state
    # A checkpoint written before runs fixed their data reads as none fixed.
    old = {k: v for k, v in state.to_json().items() if k != "data"}
    assert RunState.from_json(old, RULES, closed=0) == replace(state, data=DataShape(), data_from="")
