"""Company sign-in against a real OpenID Connect provider (django-oauth-toolkit's, started
in a process of its own by tests/support/oidc.py): the code flow with state, nonce and PKCE,
the provider's groups mapped to workspace roles and re-synced at each sign-in, local
passwords beside it, and every failure a page of ours, never a 500 or the provider's text.

The console side is Django's test client; the provider side is real HTTP with httpx, filling
the provider's own sign-in form; the console's backend talks to the provider over HTTP too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.test import Client
from django.utils.html import escape
from guardian.shortcuts import get_objects_for_user

from console import signin
from executor import engine
from executor.ledger.records import (
    Agent,
    Run,
    SignInIdentity,
    SignInRole,
    Step,
    Workspace,
    WorkspaceRole,
)
from executor.ledger.states import State
from executor.policy import authorization
from executor.services.posting import step_post
from executor.services.reviews import step_approve
from executor.services.signin import (
    Person,
    _identity_create,
    sign_in_role_save,
    sign_in_user,
)
from executor.services.tools import tool_policy_set
from tests.support.oidc import (
    CALLBACK,
    CLIENT_ID,
    CLIENT_SECRET,
    COMPANY,
    Provider,
    console_sign_in,
    free_port,
    start_provider,
)

pytestmark = pytest.mark.django_db

APPROVERS = "stepward-approvers"
REVIEWERS = "stepward-reviewers"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    started = start_provider(tmp_path_factory.mktemp("provider"), [f"http://testserver{CALLBACK}"])
    yield started
    started.stop()


@pytest.fixture
def company(settings: Any, provider: Provider) -> Provider:
    """The console set up for the provider, as docs/sign-in.md says: the issuer, the client
    and its secret; every endpoint found by discovery."""
    settings.OIDC_ISSUER = provider.issuer
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_PROVIDER_NAME = COMPANY
    settings.OIDC_RP_SCOPES = "openid email profile groups"
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    signin.discovery_forget()
    return provider


def role(workspace: Workspace, idp_group: str, name: str) -> SignInRole:
    return sign_in_role_save(role=SignInRole(workspace=workspace, idp_group=idp_group, role=name))


def holds(user: User, permission: str, workspace: Workspace) -> bool:
    """As the console sees it (guardian) and, for what the engine rechecks at every claim,
    as the engine sees it: the two agree."""
    fresh = User.objects.get(pk=user.pk)  # no permission cache
    by_guardian = fresh.has_perm(f"executor.{permission}", workspace)
    if permission in authorization.WORKSPACE_CODENAMES:
        facts = authorization.grants(users=[user.pk], workspaces=[workspace.pk], tools=[])
        assert ((user.pk, permission, workspace.pk, "") in facts) == by_guardian
    return by_guardian


def shows(answer: Any, message: str) -> bool:
    return escape(message) in answer.content.decode()


def signed_in_user(client: Client) -> User | None:
    user_id = client.session.get("_auth_user_id")
    return User.objects.get(pk=user_id) if user_id else None


def sign_in(client: Client, username: str, password: str) -> Any:
    path, query = console_sign_in(client, username, password)
    return client.get(f"{path}?{query}")


# --- the sign-in page ---------------------------------------------------------------------


def test_without_a_provider_the_page_offers_passwords_only_and_they_work(
    client: Client, reviewer: User
) -> None:
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    assert b"Sign in with" not in page.content
    assert client.get("/accounts/oidc/start/").status_code == 404
    assert client.get(f"{CALLBACK}?code=x&state=y").status_code == 404

    answer = client.post("/accounts/login/", {"username": "bob", "password": "bob-pw"})
    assert answer.status_code == 302
    assert signed_in_user(client) == reviewer


def test_with_a_provider_the_page_offers_it_and_passwords_still_work(
    client: Client, company: Provider, reviewer: User
) -> None:
    page = client.get("/accounts/login/?next=/runs/")
    assert page.status_code == 200
    text = page.content.decode()
    assert f"Sign in with {COMPANY}" in text
    assert 'href="/accounts/oidc/start/?next=/runs/"' in text
    assert 'data-testid="login-form"' in text

    answer = client.post("/accounts/login/", {"username": "bob", "password": "bob-pw"})
    assert answer.status_code == 302
    assert signed_in_user(client) == reviewer


# --- the code flow, groups and roles --------------------------------------------------------


def test_the_code_flow_signs_in_with_the_role_the_group_maps_to(
    client: Client, company: Provider, workspace: Workspace, other_workspace: Workspace
) -> None:
    role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    role(other_workspace, REVIEWERS, WorkspaceRole.REVIEWER)
    subject = company.person(
        "alice",
        "alice-at-example",
        [APPROVERS, "everyone"],
        email="alice@example.com",
        first_name="Alice",
        last_name="Liddell",
    )

    start = client.get("/accounts/oidc/start/", {"next": "/runs/"})
    authorize = parse_qs(urlsplit(start["Location"]).query)
    # The library's state and nonce, and a PKCE challenge the provider requires.
    assert authorize["state"]
    assert authorize["nonce"]
    assert authorize["code_challenge_method"] == ["S256"]
    assert authorize["redirect_uri"] == [f"http://testserver{CALLBACK}"]

    path, query = console_sign_in(client, "alice", "alice-at-example", next_url="/runs/")
    answer = client.get(f"{path}?{query}")
    assert answer.status_code == 302
    assert answer["Location"] == "/runs/"

    alice = signed_in_user(client)
    assert alice is not None
    assert (alice.username, alice.email, alice.first_name) == (
        "alice",
        "alice@example.com",
        "Alice",
    )
    assert not alice.has_usable_password()
    identity = SignInIdentity.objects.get(user=alice)
    assert (identity.issuer, identity.subject) == (company.issuer, subject)
    assert identity.idp_groups == ["everyone", APPROVERS]

    # An approver on acme, nothing more; nothing on the other workspace.
    for permission in ("review_steps", "resolve_unknown", "approve_steps", "approve_compensation"):
        assert holds(alice, permission, workspace), permission
        assert alice.has_perm(f"executor.{permission}", workspace)
    assert not holds(alice, "replay_deadletter", workspace)
    assert not holds(alice, "extend_budget", workspace)
    assert not alice.is_staff
    assert list(get_objects_for_user(alice, "executor.review_steps", klass=Workspace)) == [
        workspace
    ]
    # The session lasts a shift, then the next sign-in re-syncs the roles.
    assert client.session.get_expiry_age() == 8 * 3600
    assert client.get("/").status_code == 200


def test_a_next_address_elsewhere_is_not_followed(client: Client, company: Provider) -> None:
    company.person("nina", "nina-at-example", [])
    path, query = console_sign_in(
        client, "nina", "nina-at-example", next_url="https://evil.example/"
    )
    answer = client.get(f"{path}?{query}")
    assert answer.status_code == 302
    assert answer["Location"] == "/"


def test_a_person_with_no_mapped_group_is_signed_in_to_no_workspace(
    client: Client, company: Provider, workspace: Workspace
) -> None:
    role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    company.person("mallory", "mallory-at-example", ["marketing"])

    assert sign_in(client, "mallory", "mallory-at-example").status_code == 302
    mallory = signed_in_user(client)
    assert mallory is not None
    assert not get_objects_for_user(mallory, "executor.review_steps", klass=Workspace).exists()
    assert not holds(mallory, "review_steps", workspace)
    assert mallory.groups.count() == 0
    inbox = client.get("/")
    assert inbox.status_code == 200
    assert b"acme" not in inbox.content.lower()


def test_a_group_removed_at_the_provider_takes_the_role_away_at_the_next_sign_in(
    company: Provider, workspace: Workspace
) -> None:
    role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    role(workspace, REVIEWERS, WorkspaceRole.REVIEWER)
    company.person("carol", "carol-at-example", [APPROVERS, REVIEWERS])
    first = Client()
    assert sign_in(first, "carol", "carol-at-example").status_code == 302
    carol = signed_in_user(first)
    assert carol is not None
    assert holds(carol, "approve_steps", workspace)

    company.person("carol", "carol-at-example", [REVIEWERS])
    second = Client()
    assert sign_in(second, "carol", "carol-at-example").status_code == 302
    assert signed_in_user(second) == carol
    assert not holds(carol, "approve_steps", workspace)
    assert holds(carol, "review_steps", workspace)

    company.person("carol", "carol-at-example", [])
    third = Client()
    assert sign_in(third, "carol", "carol-at-example").status_code == 302
    assert not holds(carol, "review_steps", workspace)
    # Her approvals authorize nothing from now on: the recheck at every claim asks for
    # approve_steps through the same grants (executor/authorization.py approval_problem).
    assert SignInIdentity.objects.get(user=carol).idp_groups == []


def test_a_role_changed_or_removed_in_the_admin_applies_at_once(
    company: Provider, workspace: Workspace
) -> None:
    mapping = role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    company.person("dave", "dave-at-example", [APPROVERS])
    client = Client()
    assert sign_in(client, "dave", "dave-at-example").status_code == 302
    dave = signed_in_user(client)
    assert dave is not None
    assert holds(dave, "approve_steps", workspace)

    mapping.role = WorkspaceRole.REVIEWER
    sign_in_role_save(role=mapping)
    assert not holds(dave, "approve_steps", workspace)
    assert holds(dave, "review_steps", workspace)

    group_id = mapping.group_id
    mapping.delete()
    assert not Group.objects.filter(pk=group_id).exists()
    assert not holds(dave, "review_steps", workspace)


def test_a_username_held_by_a_local_account_is_never_taken_over(
    client: Client, company: Provider, owner: User, workspace: Workspace
) -> None:
    """The provider's `admin` is not the console's superuser `admin`: people are found by
    issuer and subject, and a new one gets a free username."""
    company.person(owner.username, "not-the-owners-password", [])
    assert sign_in(client, owner.username, "not-the-owners-password").status_code == 302
    newcomer = signed_in_user(client)
    assert newcomer is not None
    assert newcomer != owner
    assert newcomer.username == f"{owner.username}-2"
    assert not newcomer.is_superuser


def test_a_deactivated_account_is_not_signed_in(
    client: Client, company: Provider, workspace: Workspace
) -> None:
    company.person("erin", "erin-at-example", [])
    assert sign_in(Client(), "erin", "erin-at-example").status_code == 302
    User.objects.filter(username="erin").update(is_active=False)

    answer = sign_in(client, "erin", "erin-at-example")
    assert answer.status_code == 403
    assert shows(answer, signin.INACTIVE)
    assert signed_in_user(client) is None


# --- failures end on our page -------------------------------------------------------------


def started_state(client: Client) -> str:
    start = client.get("/accounts/oidc/start/")
    return parse_qs(urlsplit(start["Location"]).query)["state"][0]


HOSTILE = "<script>alert('owned')</script> Your account is suspended, call +1 555 0100"


def test_a_provider_error_with_this_browsers_state_shows_only_a_generic_message(
    client: Client, company: Provider
) -> None:
    state = started_state(client)
    answer = client.get(
        CALLBACK,
        {"error": "access_denied", "error_description": HOSTILE, "state": state},
    )
    assert answer.status_code == 403
    text = answer.content.decode()
    assert escape(signin.NOT_SIGNED_IN.format(company=COMPANY)) in text
    for shown in ("owned", "suspended", "access_denied"):
        assert shown not in text
    # The state is spent: the same answer cannot be replayed.
    assert state not in client.session.get("oidc_states", {})


def test_a_provider_error_without_a_state_of_this_browser_is_not_reflected(
    client: Client, company: Provider, reviewer: User
) -> None:
    client.force_login(reviewer)
    started_state(client)
    for query in (
        {"error": HOSTILE, "error_description": HOSTILE, "state": "forged"},
        {"error": HOSTILE, "error_description": HOSTILE},
    ):
        answer = client.get(CALLBACK, query)
        assert answer.status_code == 403
        text = answer.content.decode()
        assert escape(signin.STALE) in text
        assert "owned" not in text
        assert "suspended" not in text
    # A link anyone can send does not sign the person out either.
    assert signed_in_user(client) == reviewer


def test_a_forged_or_replayed_callback_is_refused(client: Client, company: Provider) -> None:
    answer = client.get(CALLBACK, {"code": "made-up", "state": "made-up"})
    assert answer.status_code == 400
    assert shows(answer, signin.STALE)

    company.person("frank", "frank-at-example", [])
    path, query = console_sign_in(client, "frank", "frank-at-example")
    assert client.get(f"{path}?{query}").status_code == 302
    other = Client()
    other.get("/accounts/oidc/start/")
    # Another browser replaying the code and state: its session never started that state.
    replayed = other.get(f"{path}?{query}")
    assert replayed.status_code == 400
    assert signed_in_user(other) is None
    # The same browser replaying it: the state was spent.
    assert client.get(f"{path}?{query}").status_code == 400


@pytest.mark.parametrize(
    ("setting", "fault"),
    [
        ("OIDC_OP_USER_ENDPOINT", "/faults/userinfo-list/"),
        ("OIDC_OP_JWKS_ENDPOINT", "/faults/jwks-without-keys/"),
        ("OIDC_OP_JWKS_ENDPOINT", "/faults/jwks-html/"),
    ],
)
def test_an_answer_of_the_wrong_shape_ends_on_the_failure_page(
    client: Client, company: Provider, settings: Any, setting: str, fault: str
) -> None:
    setattr(settings, setting, company.url + fault)
    company.person("grace", "grace-at-example", [])

    answer = sign_in(client, "grace", "grace-at-example")
    assert answer.status_code == 502
    assert shows(answer, signin.UNVERIFIED.format(company=COMPANY))
    assert signed_in_user(client) is None
    assert not User.objects.filter(username="grace").exists()


def test_with_every_endpoint_set_discovery_is_not_used(
    client: Client, company: Provider, settings: Any
) -> None:
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = f"{company.issuer}/authorize/"
    settings.OIDC_OP_TOKEN_ENDPOINT = f"{company.issuer}/token/"
    settings.OIDC_OP_USER_ENDPOINT = f"{company.issuer}/userinfo/"
    settings.OIDC_OP_JWKS_ENDPOINT = f"{company.issuer}/.well-known/jwks.json"
    company.person("leo", "leo-at-example", [])

    assert sign_in(client, "leo", "leo-at-example").status_code == 302
    assert signed_in_user(client) == User.objects.get(username="leo")
    assert signin._discovered == {}


def test_a_provider_that_cannot_be_reached_ends_on_the_failure_page(
    client: Client, company: Provider, settings: Any
) -> None:
    settings.OIDC_ISSUER = f"http://127.0.0.1:{free_port()}/o"
    signin.discovery_forget()
    answer = client.get("/accounts/oidc/start/")
    assert answer.status_code == 502
    assert shows(answer, signin.UNREACHABLE.format(company=COMPANY))


def test_a_discovery_document_of_another_issuer_is_refused(
    client: Client, company: Provider, settings: Any
) -> None:
    # The provider answers discovery at its issuer's path only; a look-alike issuer is
    # refused rather than trusted.
    settings.OIDC_ISSUER = company.issuer + "/"
    signin.discovery_forget()
    answer = client.get("/accounts/oidc/start/")
    assert answer.status_code == 502


def test_id_token_checks_the_library_leaves_to_us() -> None:
    issuer = "https://sso.example.com"
    good = {"iss": issuer, "aud": "console", "sub": "42"}
    assert signin.id_token_problem(good, issuer=issuer, client_id="console") == ""
    for bad in (
        {**good, "iss": "https://evil.example.com"},
        {**good, "aud": "another-app"},
        {**good, "aud": ["another-app"]},
        {**good, "sub": ""},
        {**good, "sub": 42},
        ["not", "a", "dict"],
    ):
        assert signin.id_token_problem(bad, issuer=issuer, client_id="console")
    assert not signin.id_token_problem(
        {**good, "aud": ["x", "console"]}, issuer=issuer, client_id="console"
    )


def test_a_group_claim_of_the_wrong_shape_is_refused() -> None:
    assert signin.claimed_groups({}, "groups") == []
    assert signin.claimed_groups({"groups": "ops"}, "groups") == ["ops"]
    assert signin.claimed_groups({"groups": ["a", "b"]}, "groups") == ["a", "b"]
    for bad in ({"groups": {"a": 1}}, {"groups": [1, 2]}, {"groups": 7}):
        with pytest.raises(signin.SignInFailed):
            signin.claimed_groups(bad, "groups")


# --- two first sign-ins at once -------------------------------------------------------------


PERSON = Person(issuer="https://sso.example.com", subject="s-1", username="henry")


def test_the_loser_of_a_first_sign_in_race_gets_the_winners_user() -> None:
    """What the second of two simultaneous first sign-ins meets: the username and the
    identity inserted by the first, after it looked and found nobody."""
    winner = _identity_create(PERSON)
    loser = _identity_create(PERSON)
    assert loser == winner
    assert User.objects.filter(username__startswith="henry").count() == 1
    assert SignInIdentity.objects.get().user == winner


def test_the_role_sync_of_a_first_sign_in_twice_is_the_same(workspace: Workspace) -> None:
    role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    first = sign_in_user(person=PERSON, idp_groups=[APPROVERS])
    again = sign_in_user(person=PERSON, idp_groups=[APPROVERS])
    assert first == again
    assert first.groups.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_first_sign_ins_at_once_end_signed_in_as_one_user(
    company: Provider, workspace: Workspace
) -> None:
    role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    company.person("ivan", "ivan-at-example", [APPROVERS])
    clients = [Client(), Client()]
    callbacks = [console_sign_in(c, "ivan", "ivan-at-example") for c in clients]
    barrier = threading.Barrier(len(clients))
    answers: list[Any] = [None] * len(clients)

    def finish(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            path, query = callbacks[index]
            answers[index] = clients[index].get(f"{path}?{query}")
        finally:
            connection.close()

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # Both signed in (never a 500), as the same one user, who holds the role.
    assert [answer.status_code for answer in answers] == [302, 302]
    users = [signed_in_user(c) for c in clients]
    assert users[0] is not None
    assert users[0] == users[1]
    assert User.objects.filter(username__startswith="ivan").count() == 1
    assert holds(users[0], "approve_steps", workspace)


# --- a demotion at the provider reaches work already approved -------------------------------


def test_an_approval_by_an_approver_demoted_at_the_provider_authorizes_nothing(
    company: Provider, workspace: Workspace, agent: Agent, run: Run
) -> None:
    role(workspace, APPROVERS, WorkspaceRole.APPROVER)
    company.person("judy", "judy-at-example", [APPROVERS])
    client = Client()
    assert sign_in(client, "judy", "judy-at-example").status_code == 302
    judy = signed_in_user(client)
    assert judy is not None
    tool_policy_set(workspace=workspace, tool="echo", approval="always")
    step, _ = step_post(
        agent=agent, run=run, key="echo-judy", tool_name="echo", input={"message": "hi"}
    )
    assert step.state == State.PLANNED
    step_approve(step=step, user=judy, version=step.version, reason="Fine to send.")

    # Judy leaves the approvers' group; her next sign-in says so, before any worker claims.
    company.person("judy", "judy-at-example", ["everyone"])
    assert sign_in(Client(), "judy", "judy-at-example").status_code == 302

    assert engine.process(step.pk) == State.BLOCKED
    blocked = Step.objects.get(pk=step.pk)
    assert blocked.failure_message == "the approver judy no longer holds approve_steps"
    assert not blocked.attempts.filter(submitted_at__isnull=False).exists()


# --- the admin ------------------------------------------------------------------------------


def test_the_admin_maps_a_group_to_a_role_and_shows_who_holds_it(
    client: Client, company: Provider, owner: User, workspace: Workspace
) -> None:
    client.force_login(owner)
    added = client.post(
        "/admin/executor/signinrole/add/",
        {"workspace": workspace.pk, "idp_group": "/stepward/approvers", "role": "approver"},
    )
    assert added.status_code == 302, added.content.decode()[:2000]
    mapping = SignInRole.objects.get(idp_group="/stepward/approvers")
    assert mapping.group.name == "sign-in acme: /stepward/approvers"

    company.person("kim", "kim-at-example", ["/stepward/approvers"])
    assert sign_in(Client(), "kim", "kim-at-example").status_code == 302
    kim = User.objects.get(username="kim")
    assert holds(kim, "approve_steps", workspace)

    listing = client.get("/admin/executor/signinrole/")
    assert listing.status_code == 200
    assert "/stepward/approvers" in listing.content.decode()
    page = client.get(f"/admin/executor/signinrole/{mapping.pk}/change/")
    assert "approve_steps" in page.content.decode()

    # The same group twice in one workspace is refused by the form, naming the clash.
    again = client.post(
        "/admin/executor/signinrole/add/",
        {"workspace": workspace.pk, "idp_group": "/stepward/approvers", "role": "reviewer"},
    )
    assert again.status_code == 200
    assert "already exists" in again.content.decode()

    changed = client.post(
        f"/admin/executor/signinrole/{mapping.pk}/change/",
        {"workspace": workspace.pk, "idp_group": "/stepward/approvers", "role": "reviewer"},
    )
    assert changed.status_code == 302
    assert not holds(kim, "approve_steps", workspace)
    assert holds(kim, "review_steps", workspace)

    identities = client.get("/admin/executor/signinidentity/")
    assert identities.status_code == 200
    assert "kim" in identities.content.decode()


# --- settings -------------------------------------------------------------------------------


def check(tmp_path: Path, **given: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OIDC_")}
    env.update(STEPWARD_VAR_DIR=str(tmp_path), PYTHONWARNINGS="ignore", **given)
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.django_db(False)
def test_a_client_without_an_issuer_is_refused_at_startup(tmp_path: Path) -> None:
    out = check(tmp_path, OIDC_RP_CLIENT_ID="stepward")
    assert out.returncode != 0
    assert "OIDC_ISSUER is not" in out.stderr
    secret = tmp_path / "client-secret"
    secret.write_text("from-a-mounted-file\n")
    out = check(
        tmp_path,
        OIDC_RP_CLIENT_ID="stepward",
        OIDC_ISSUER="https://sso.example.com/realms/acme",
        OIDC_RP_CLIENT_SECRET_FILE=str(secret),
    )
    assert out.returncode == 0, out.stderr
    out = check(
        tmp_path,
        OIDC_RP_CLIENT_ID="stepward",
        OIDC_ISSUER="https://sso.example.com/realms/acme",
        OIDC_RP_CLIENT_SECRET_FILE=str(tmp_path / "missing"),
    )
    assert out.returncode != 0
    assert "OIDC_RP_CLIENT_SECRET_FILE" in out.stderr
