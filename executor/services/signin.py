"""Company sign-in's writes: the groups that carry workspace roles, and the users the identity
provider signs in, with their roles re-synced from its group claim at every sign-in."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, User
from django.db import IntegrityError, transaction
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executor.ledger.records import (
    ROLE_PERMISSIONS,
    WORKSPACE_PERMISSIONS,
    SignInIdentity,
    SignInRole,
)
from executor.services.base import ServiceError

# Letters, digits and @.+-_ are what Django's username validator allows.
USERNAME_UNSAFE = re.compile(r"[^\w.@+-]", re.ASCII)
USERNAME_TRIES = 20


class SignInRefused(ServiceError):
    """The provider's answer cannot make a user: the message is ours, safe to show."""

    code = "sign_in_refused"


def sign_in_role_save(*, role: SignInRole) -> SignInRole:
    """Saves the mapping and makes its group hold exactly its role's permissions on its
    workspace: a role changed in the admin applies at once to everyone who holds it."""
    with transaction.atomic():
        name = _group_name(role)
        if role.group_id is None:
            role.group = Group.objects.create(name=name)
        elif role.group.name != name and not Group.objects.filter(name=name).exists():
            role.group.name = name
            role.group.save(update_fields=["name"])
        role.save()
        wanted = set(ROLE_PERMISSIONS[role.role])
        for codename, _ in WORKSPACE_PERMISSIONS:
            if codename in wanted:
                assign_perm(f"executor.{codename}", role.group, role.workspace)
            else:
                remove_perm(f"executor.{codename}", role.group, role.workspace)
    return role


def _group_name(role: SignInRole) -> str:
    """A name that says what the group is, unique among groups (Group.name is)."""
    name = f"sign-in {role.workspace.slug}: {role.idp_group}"
    taken = Group.objects.filter(name=name).exclude(pk=role.group_id).exists()
    if len(name) <= 150 and not taken:
        return name
    digest = hashlib.sha256(f"{role.workspace_id}/{role.idp_group}".encode()).hexdigest()[:12]
    return f"{name[:130]}… {digest}"


@dataclass(frozen=True)
class Person:
    """What the provider said about who signs in: the subject is the key, the rest is shown."""

    issuer: str
    subject: str
    username: str
    email: str = ""
    first_name: str = ""
    last_name: str = ""


def sign_in_user(*, person: Person, idp_groups: Collection[str]) -> User:
    """The user the provider signed in (made at the first sign-in), its profile refreshed and
    its roles made exactly those its groups map to: a group removed at the provider takes
    its role away here.

    Two first sign-ins of one person at once make one user: the second finds the first's.
    """
    identity = SignInIdentity.objects.select_related("user").filter(
        issuer=person.issuer, subject=person.subject
    )
    found = identity.first()
    user = found.user if found is not None else _identity_create(person)
    try:
        with transaction.atomic():
            _profile_refresh(user, person)
            sign_in_roles_sync(user=user, idp_groups=idp_groups)
            identity.update(idp_groups=sorted(idp_groups), last_sign_in_at=timezone.now())
    except IntegrityError as error:
        # A mapping deleted in the admin while this sign-in added its group.
        raise SignInRefused("the roles changed during your sign-in; sign in again") from error
    return user


def _identity_create(person: Person) -> User:
    user_model = get_user_model()
    base = _username_base(person)
    for attempt in range(USERNAME_TRIES):
        username = base if attempt == 0 else f"{base[:140]}-{attempt + 1}"
        if user_model.objects.filter(username__iexact=username).exists():
            continue
        try:
            with transaction.atomic():
                user = user_model.objects.create_user(username=username, email=person.email)
                user.set_unusable_password()
                user.save(update_fields=["password"])
                SignInIdentity.objects.create(
                    user=user, issuer=person.issuer, subject=person.subject
                )
                return user
        except IntegrityError:
            # Another sign-in won a race: for this same person (use its user), or for
            # someone else who wanted this username (try the next).
            winner = SignInIdentity.objects.filter(issuer=person.issuer, subject=person.subject)
            existing = winner.select_related("user").first()
            if existing is not None:
                return existing.user
    raise SignInRefused(f"no free username near {base!r} for this account; ask an administrator")


def _username_base(person: Person) -> str:
    wanted = person.username or person.email or person.subject
    cleaned = USERNAME_UNSAFE.sub("_", wanted).strip("._-@+")[:150]
    return cleaned or f"user-{hashlib.sha256(person.subject.encode()).hexdigest()[:10]}"


def _profile_refresh(user: User, person: Person) -> None:
    fields = {
        "email": person.email[:254],
        "first_name": person.first_name[:150],
        "last_name": person.last_name[:150],
    }
    changed = [name for name, value in fields.items() if getattr(user, name) != value]
    for name in changed:
        setattr(user, name, fields[name])
    if changed:
        user.save(update_fields=changed)


def sign_in_roles_sync(*, user: User, idp_groups: Collection[str]) -> set[int]:
    """Makes the user a member of exactly the role groups its provider groups map to.

    Returns the ids of the role groups it holds. Groups that are no role's are left alone.
    """
    mapped = SignInRole.objects.filter(idp_group__in=set(idp_groups))
    wanted = set(mapped.values_list("group_id", flat=True))
    held = set(user.groups.filter(sign_in_role__isnull=False).values_list("id", flat=True))
    if held - wanted:
        user.groups.remove(*(held - wanted))
    if wanted - held:
        user.groups.add(*(wanted - held))
    return wanted
