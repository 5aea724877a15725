"""Approval rules (issue 23.1, API.md "Approval rules"): `[[rule]]` tables with CEL
conditions decide, first match first, whether a call runs alone, waits for one person or two,
or is refused; rules are part of the policy version; expressions are checked on load and
bounded when evaluated; `rules_simulate` says what rules would have done."""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from guardian.shortcuts import assign_perm

from executor import engine
from executor.common import conditions, dispatch
from executor.contract.tool import Effect, Idempotency, register, unregister
from executor.engine import progress
from executor.ledger import transitions
from executor.ledger.records import Agent, Approval, Rule, Run, Signoff, Workspace
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services import reviews
from executor.services.accounts import reviewer_create
from executor.services.base import NotPermitted
from executor.services.posting import step_requirement
from executor.services.reviews import (
    ApprovalOutcome,
    ApprovalResult,
    step_approval_status,
    step_approval_try,
    step_approve,
    step_resume,
    steps_approve,
)
from executor.services.tools import tools_sync
from tests.support import tooling
from tests.support.tooling import ScriptedTool, post, reload

pytestmark = pytest.mark.django_db


class RefundTool(ScriptedTool):
    """A refund: a write the payment system deduplicates by key; no approval of its own."""

    name = "payments.refund"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY


@pytest.fixture(autouse=True)
def engine_env(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        register(RefundTool)
        tools_sync()
        assign_perm("executor.use_tool", agent.user, ToolRow.objects.get(name=RefundTool.name))
        try:
            yield
        finally:
            unregister(RefundTool.name)
            RefundTool.reset()


@pytest.fixture
def dora(workspace: Workspace) -> User:
    """A second reviewer."""
    return reviewer_create(workspace=workspace, username="dora", password="dora-pw")


REFUND_RULES = """
[[rule]]
tool = "payments.refund"
when = "input.amount > 1000"
action = "require_two"
reason = "refunds over 1,000 need two people"

[[rule]]
tool = "payments.refund"
when = "input.amount > 100"
action = "require_approval"
reason = "refunds over 100 need a person"
"""


def load(tmp_path: Path, text: str, *options: str) -> str:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    out = StringIO()
    call_command("load_tools", str(path), *options, stdout=out)
    return out.getvalue()


def refund(agent: Agent, run: Run, amount: int, key: str | None = None) -> Any:
    return post(
        agent, run, RefundTool.name, key=key or f"refund-{amount}", input={"amount": amount}
    )


def approve(step: Any, user: User) -> ApprovalResult:
    step = reload(step)
    return step_approval_try(step=step, user=user, version=step.version, reason="ok")


# --- what the rules decide ------------------------------------------------------------------


def test_a_refund_of_50_completes_alone_500_waits_for_a_person_5000_needs_two(
    agent: Agent, run: Run, reviewer: User, dora: User, tmp_path: Path
) -> None:
    said = load(tmp_path, REFUND_RULES)
    assert "2 rules replaced the 0 before" in said

    small, medium, large = (refund(agent, run, amount) for amount in (50, 500, 5000))

    assert small.state == State.PENDING
    assert engine.process(small.pk, worker="w1") == State.COMPLETED

    assert medium.state == State.PLANNED
    assert engine.process(medium.pk, worker="w1") == engine.Outcome.SKIPPED
    assert approve(medium, reviewer).outcome == ApprovalOutcome.APPROVED
    assert engine.process(medium.pk, worker="w1") == State.COMPLETED

    assert large.state == State.PLANNED
    first = approve(large, reviewer)
    assert first.outcome == ApprovalOutcome.WAITING
    assert first.approvers == ("bob",)
    assert first.still_needed == 1
    assert reload(large).state == State.PLANNED
    assert step_approval_status(reload(large))["approvers"] == ["bob"]
    again = approve(large, reviewer)
    assert again.outcome == ApprovalOutcome.REFUSED
    assert "second, different reviewer" in again.message
    assert reload(large).state == State.PLANNED
    second = approve(large, dora)
    assert second.outcome == ApprovalOutcome.APPROVED
    assert second.approvers == ("bob", "dora")
    assert engine.process(large.pk, worker="w1") == State.COMPLETED
    approval = Approval.objects.get(step=large, approver__isnull=False)
    assert {s.approver.username for s in Signoff.objects.filter(approval=approval)} == {
        "bob",
        "dora",
    }
    approved_event = large.events.get(to_state=State.APPROVED)
    assert approved_event.data["approvers"] == ["user:bob", "user:dora"]
    assert len(RefundTool.calls) == 3


def test_the_first_matching_rule_decides(agent: Agent, run: Run, tmp_path: Path) -> None:
    # The same two rules, the broader one moved first by its `order`: it matches 5,000
    # too, and decides.
    reordered = REFUND_RULES.replace(
        'reason = "refunds over 100 need a person"',
        'reason = "refunds over 100 need a person"\norder = 0',
    )
    load(tmp_path, reordered)

    large = refund(agent, run, 5000)

    requirement = step_requirement(large)
    assert requirement.need == 1
    assert "refunds over 100 need a person" in requirement.describe()


def test_no_matching_rule_falls_back_to_the_tools_own_approval(
    agent: Agent, run: Run, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)

    # test.destructive needs a person by its own declaration; no rule names it.
    assert post(agent, run, "test.destructive").state == State.PLANNED
    assert post(agent, run, "test.pure").state == State.PENDING


def test_a_rule_for_every_tool_and_one_workspace_applies_there_only(
    agent: Agent, run: Run, other_workspace: Workspace, tmp_path: Path
) -> None:
    load(
        tmp_path,
        f"""
[[rule]]
tool = "*"
workspace = "{other_workspace.slug}"
when = "true"
action = "refuse"
reason = "globex is frozen"
""",
    )

    assert refund(agent, run, 5).state == State.PENDING


def test_a_condition_reads_the_tool_the_agent_and_the_run(
    agent: Agent, run: Run, tmp_path: Path
) -> None:
    load(
        tmp_path,
        f"""
[[rule]]
tool = "*"
when = "tool.effect == 'write' && agent.name == '{agent.name}' && run.name == '{run.name}'"
action = "require_approval"
""",
    )

    assert refund(agent, run, 5).state == State.PLANNED
    assert post(agent, run, "test.pure").state == State.PENDING


def test_refuse_fails_the_step_as_policy_denied_with_the_rules_reason(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    load(
        tmp_path,
        """
[[rule]]
tool = "payments.refund"
when = "input.amount >= 100000"
action = "refuse"
reason = "refunds of 100,000 or more are made by finance"
""",
    )

    huge = refund(agent, run, 100000)

    assert huge.state == State.FAILED
    assert huge.failure_class == "policy_denied"
    assert huge.failure_message == "refunds of 100,000 or more are made by finance"
    assert RefundTool.calls == []


def test_a_call_refused_by_a_rule_made_after_it_was_approved_fails_at_its_claim(
    agent: Agent, run: Run, tmp_path: Path
) -> None:
    step = refund(agent, run, 700)
    assert step.state == State.PENDING  # no rules yet: the policy approved it

    load(
        tmp_path,
        """
[[rule]]
tool = "payments.refund"
when = "input.amount > 500"
action = "refuse"
reason = "no refunds over 500 this week"
""",
    )

    assert engine.process(step.pk, worker="w1") == State.FAILED
    failed = reload(step)
    assert failed.failure_class == "policy_denied"
    assert "no refunds over 500 this week" in failed.failure_message
    assert RefundTool.calls == []


def test_a_rule_refuses_a_reviewers_approval_of_a_call_it_refuses(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 500)
    load(
        tmp_path,
        REFUND_RULES
        + """
[[rule]]
tool = "*"
order = 0
when = "true"
action = "refuse"
reason = "frozen"
""",
    )

    result = approve(step, reviewer)

    assert result.outcome == ApprovalOutcome.REFUSED
    assert "frozen" in result.message
    assert reload(step).state == State.PLANNED


# --- versioned as policy --------------------------------------------------------------------


def test_a_rule_change_invalidates_an_approval_given_before_it(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 500)
    assert approve(step, reviewer).outcome == ApprovalOutcome.APPROVED

    said = load(tmp_path, REFUND_RULES.replace("refunds over 100 need a person", "reworded"))

    assert "approvals given under the old rules no longer hold" in said
    assert engine.process(step.pk, worker="w1") == State.BLOCKED
    assert "policy changed since the approval" in reload(step).failure_message
    assert RefundTool.calls == []


def test_loading_the_same_rules_again_keeps_every_approval(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 500)
    approve(step, reviewer)

    said = load(tmp_path, REFUND_RULES)

    assert "2 rules: unchanged" in said
    assert engine.process(step.pk, worker="w1") == State.COMPLETED


def test_an_edit_in_admin_is_a_new_version_too(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 500)
    approve(step, reviewer)

    rule = Rule.objects.get(action="require_approval")
    rule.when = "input.amount > 99"
    rule.full_clean()
    rule.save()

    assert engine.process(step.pk, worker="w1") == State.BLOCKED


def test_a_first_approval_under_the_old_rules_does_not_count_toward_two(
    agent: Agent, run: Run, reviewer: User, dora: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 5000)
    assert approve(step, reviewer).outcome == ApprovalOutcome.WAITING

    load(tmp_path, REFUND_RULES.replace("two people", "two people, always"))

    result = approve(step, dora)
    assert result.outcome == ApprovalOutcome.WAITING
    assert result.approvers == ("dora",)


def test_a_blocked_step_under_require_two_resumes_only_with_two_reviewers(
    agent: Agent, run: Run, reviewer: User, dora: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 5000)
    approve(step, reviewer)
    approve(step, dora)
    load(tmp_path, REFUND_RULES.replace("two people", "two people!"))
    assert engine.process(step.pk, worker="w1") == State.BLOCKED

    blocked = reload(step)
    step_resume(step=blocked, user=reviewer, version=blocked.version, reason="still ok")
    assert reload(step).state == State.BLOCKED
    with pytest.raises(NotPermitted, match="already approved"):
        step_resume(step=blocked, user=reviewer, version=blocked.version, reason="ok")
    step_resume(step=blocked, user=dora, version=blocked.version, reason="agreed")

    assert reload(step).state == State.PENDING
    assert engine.process(step.pk, worker="w1") == State.COMPLETED


def test_an_approval_by_one_person_does_not_pass_a_claim_that_needs_two(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    """The claim rechecks the two signoffs itself: an approval made some other way (one
    reviewer's resume under the old code, a hand-made row) authorizes nothing."""
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 5000)
    first = approve(step, reviewer)
    assert first.outcome == ApprovalOutcome.WAITING
    # Forge the second half: an Approval row by the same reviewer, the step moved on.
    fresh = reload(step)
    reviews._approve(fresh, user=reviewer, reason="forged", now=fresh.updated_at)
    transitions.move(fresh, State.APPROVED, actor="user:bob", reason="forged")
    progress.promote_ready(run_ids=[run.pk])

    assert engine.process(step.pk, worker="w1") == State.BLOCKED
    assert "2 different reviewers" in reload(step).failure_message
    assert RefundTool.calls == []


# --- checked on load, bounded when run ----------------------------------------------------


def test_a_bad_expression_is_refused_on_load_with_its_position(
    tmp_path: Path, workspace: Workspace
) -> None:
    bad = (
        REFUND_RULES + '\n[[rule]]\ntool = "*"\nwhen = "input.amount > 100 &&"\naction = "allow"\n'
    )

    with pytest.raises(CommandError) as refused:
        load(tmp_path, bad)

    assert "[[rule]] #3: when: line 1, column 20: syntax error" in str(refused.value)
    assert Rule.objects.count() == 0  # all or nothing


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("input.amount >", "line 1, column 14: syntax error"),
        (
            "input.amount > 100\n  && fileRead('/etc/passwd')",
            "line 2, column 6: no function 'fileRead'",
        ),
        ("env.HOME != ''", "line 1, column 1: unknown name 'env'"),
        ("input.items.reduce(x, 1)", "no method 'reduce'"),
        ('input.to.endsWith("@acme.com") == 1 ||| true', "line 1, column"),
    ],
)
def test_each_kind_of_bad_expression_names_where(when: str, message: str) -> None:
    with pytest.raises(conditions.ConditionError) as refused:
        conditions.compile_condition(when)

    assert message in str(refused.value)


def test_admin_refuses_a_bad_expression_with_its_position(workspace: Workspace) -> None:
    rule = Rule(tool="*", when="input.amount >>> 3", action="allow")

    with pytest.raises(ValidationError) as refused:
        rule.full_clean()

    assert "line 1, column" in str(refused.value.message_dict["when"])


@pytest.mark.parametrize(
    "when",
    [
        "open('/etc/passwd') == ''",
        "__import__('os').system('id') == 0",
        "read('/etc/passwd').size() > 0",
        "input.path.readFile() == ''",
        "google.protobuf.Struct{} == {}",
    ],
)
def test_an_expression_cannot_read_files_or_run_code(when: str) -> None:
    with pytest.raises(conditions.ConditionError):
        conditions.compile_condition(when)


def test_an_expression_that_would_loop_is_refused_or_stopped(
    agent: Agent, run: Run, tmp_path: Path
) -> None:
    # A macro within a macro would cost the square of what the agent sent: refused on load.
    with pytest.raises(conditions.ConditionError, match="inside another macro"):
        conditions.compile_condition("input.items.all(x, input.items.all(y, x <= y))")

    # One macro over a long list: its evaluation stops at the cost bound, and the rule that
    # asks for a person fails safe: it counts as matching.
    load(
        tmp_path,
        """
[[rule]]
tool = "payments.refund"
when = "input.items.all(x, x >= 0) && input.items.exists(x, x == -1)"
action = "require_approval"
reason = "checked lines"
""",
    )
    long = post(
        agent, run, RefundTool.name, key="long", input={"amount": 1, "items": list(range(5000))}
    )
    short = post(agent, run, RefundTool.name, key="short", input={"amount": 1, "items": [1, 2]})

    assert long.state == State.PLANNED
    described = step_requirement(long).describe()
    assert "could not be evaluated" in described
    assert "costs more than" in described or "took longer than" in described
    assert short.state == State.PENDING
    condition = conditions.compile_condition("input.items.all(x, x >= 0)")
    with pytest.raises(conditions.EvaluationError, match=r"costs more than|took longer than"):
        condition.evaluate({"input": {"items": list(range(5000))}})


def test_an_allow_rule_whose_condition_fails_does_not_allow(
    agent: Agent, run: Run, tmp_path: Path
) -> None:
    load(
        tmp_path,
        """
[[rule]]
tool = "test.destructive"
when = "input.trusted == true"
action = "allow"
""",
    )

    # `trusted` is missing: the condition errs, the allow rule does not match, the tool's
    # own declaration (a person) holds.
    assert post(agent, run, "test.destructive", input={"n": 1}).state == State.PLANNED
    assert post(agent, run, "test.destructive", input={"trusted": True}).state == State.PENDING


def test_the_api_example_condition_works(agent: Agent, run: Run, tmp_path: Path) -> None:
    load(
        tmp_path,
        """
[[rule]]
tool = "payments.refund"
when = "input.amount > 100 || !input.currency.startsWith('EU')"
action = "require_approval"
""",
    )

    eur = post(agent, run, RefundTool.name, key="eur", input={"amount": 5, "currency": "EUR"})
    usd = post(agent, run, RefundTool.name, key="usd", input={"amount": 5, "currency": "USD"})

    assert (eur.state, usd.state) == (State.PENDING, State.PLANNED)


def test_a_rule_table_with_unknown_keys_or_values_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as refused:
        load(
            tmp_path,
            '[[rule]]\ntool = "*"\nwhen = "true"\naction = "maybe"\nworkspace = "nope"\nx = 1\n',
        )

    text = str(refused.value)
    assert "3 problem(s)" in text
    assert Rule.objects.count() == 0


# --- what the rules would have done -------------------------------------------------------


def test_rules_simulate_says_what_the_rules_would_have_done_to_recent_calls(
    agent: Agent, run: Run, workspace: Workspace, tmp_path: Path
) -> None:
    for amount in (50, 500, 5000, 20):
        refund(agent, run, amount)
    path = tmp_path / "candidate.toml"
    path.write_text(REFUND_RULES)
    out = StringIO()

    call_command(
        "rules_simulate", str(path), "--workspace", workspace.slug, "--last", "10", stdout=out
    )

    text = out.getvalue()
    assert "4 recent call(s) in acme, weighed against the 2 rule(s) of" in text
    assert "  allow: 2\n  require_approval: 1\n  require_two: 1\n  refuse: 0\n" in text
    assert "different from what happened: 2" in text
    assert "| payments.refund | refund-5000 | require_two * | allowed (pending) |" in text
    assert "| payments.refund | refund-500 | require_approval * | allowed (pending) |" in text
    assert "refund-50 |" not in text  # allowed calls are listed only with --all
    assert Rule.objects.count() == 0  # a simulation writes nothing


def test_rules_simulate_without_a_file_weighs_the_rules_in_force(
    agent: Agent, run: Run, reviewer: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    step = refund(agent, run, 500)
    approve(step, reviewer)
    out = StringIO()

    call_command("rules_simulate", "--last", "1", stdout=out)

    text = out.getvalue()
    assert "weighed against the rules in force" in text
    assert "| refund-500 | require_approval | approved by bob |" in text
    assert "different from what happened: 0" in text


def test_rules_simulate_refuses_a_bad_file_and_a_bad_workspace(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[rule]]\ntool = "*"\nwhen = "1 +"\naction = "allow"\n')

    with pytest.raises(CommandError, match="problem"):
        call_command("rules_simulate", str(path), stdout=StringIO(), stderr=StringIO())
    with pytest.raises(CommandError, match="no workspace 'nope'"):
        call_command("rules_simulate", "--workspace", "nope", stdout=StringIO())


# --- admin ----------------------------------------------------------------------------------


def test_a_rules_admin_page_shows_what_the_rules_would_do_to_recent_calls(
    client: Any, owner: User, reviewer: User, agent: Agent, run: Run, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    for amount in (50, 500, 5000):
        large = refund(agent, run, amount)
    approve(large, reviewer)
    client.force_login(owner)
    step_page = client.get(f"/admin/executor/step/{large.pk}/change/").content.decode()
    assert "Signoffs" in step_page
    assert ">bob<" in step_page
    rule = Rule.objects.get(action="require_two")

    page = client.get(f"/admin/executor/rule/{rule.pk}/change/")

    assert page.status_code == 200
    text = page.content.decode()
    assert (
        "Of the last 3 calls of payments.refund in every workspace: 1 allowed, 1 to one "
        "person, 1 to two, 0 refused; this rule decides 1 of them." in text
    )
    assert "refund-5000" in text
    assert "refund-500<" not in text


def test_admin_refuses_a_rule_whose_condition_is_bad_and_saves_a_good_one(
    client: Any, owner: User
) -> None:
    client.force_login(owner)
    form = {"position": "1", "tool": "*", "when": "input.x >", "action": "allow", "reason": ""}

    refused = client.post("/admin/executor/rule/add/", form)

    assert refused.status_code == 200
    assert "line 1, column" in refused.content.decode()
    assert Rule.objects.count() == 0
    saved = client.post("/admin/executor/rule/add/", {**form, "when": "has(input.x)"})
    assert saved.status_code == 302
    assert Rule.objects.get().digest


def test_the_example_rules_file_loads_and_decides_as_its_comments_say(
    agent: Agent, run: Run, api: Any
) -> None:
    out = StringIO()
    call_command("load_tools", str(EXAMPLE_RULES), stdout=out)
    assert "4 rules replaced the 0 before" in out.getvalue()

    eur = refund_in(agent, run, "eur-50", {"amount": 50, "currency": "EUR"})
    usd = refund_in(agent, run, "usd-50", {"amount": 50, "currency": "USD"})
    big = refund_in(agent, run, "eur-5000", {"amount": 5000, "currency": "EUR"})
    assert [s.state for s in (eur, usd, big)] == [State.PENDING, State.PLANNED, State.PLANNED]
    assert step_requirement(big).need == 2

    # Through the API: a refused call is recorded, failed as policy_denied, with the reason.
    response = api.post(
        f"/api/v1/runs/{run.pk}/steps",
        {
            "key": "mail-out",
            "tool": "email.send",
            "input": {"to": "eve@elsewhere.example", "subject": "hi", "body": "x"},
        },
    )
    assert response.status_code == 201
    answer = response.json()
    assert answer["state"] == "failed"
    assert answer["failure"] == {
        "class": "policy_denied",
        "message": "mail leaves the company only from people",
    }


EXAMPLE_RULES = Path(__file__).resolve().parents[2] / "examples" / "rules.toml"


def refund_in(agent: Agent, run: Run, key: str, input: dict[str, Any]) -> Any:
    return post(agent, run, RefundTool.name, key=key, input=input)


def test_approving_many_answers_each_steps_outcome(
    agent: Agent, run: Run, reviewer: User, dora: User, tmp_path: Path
) -> None:
    load(tmp_path, REFUND_RULES)
    one, two, stale = (refund(agent, run, amount) for amount in (500, 5000, 700))
    seen_stale = stale.version
    step_approve(step=stale, user=dora, version=stale.version, reason="first")

    results = steps_approve(
        steps=[(one, one.version), (two, two.version), (stale, seen_stale)],
        user=reviewer,
        reason="batch of refunds checked",
    )

    assert [r.outcome for r in results] == [
        ApprovalOutcome.APPROVED,
        ApprovalOutcome.WAITING,
        ApprovalOutcome.REFUSED,
    ]
    assert results[1].still_needed == 1
    assert results[2].code == "already_handled"
    assert "Already handled by user:dora" in results[2].message
