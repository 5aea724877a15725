"""`manage.py create_reviewer USERNAME --workspace SLUG [--password P]` (API.md)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.validators import validate_slug
from django.db import models, transaction

from executor.ledger.records import REVIEWER_PERMISSIONS, Agent, Workspace
from executor.services.accounts import reviewer_create, workspace_get_or_create


class Command(BaseCommand):
    help = (
        "Creates a console user, or updates an existing one, with every reviewer permission "
        "on the workspace (created if needed). Running it again is harmless."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--workspace", required=True, metavar="SLUG")
        parser.add_argument(
            "--password",
            help="sets (or resets) the password; without it a new user cannot log in yet",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        username: str = options["username"].strip()
        slug: str = options["workspace"]
        password: str | None = options["password"]
        user_model = get_user_model()
        try:
            validate_slug(slug)
        except ValidationError:
            raise CommandError(f"--workspace {slug!r} is not a slug") from None
        if not username:
            raise CommandError("the username must not be empty")
        try:
            # The field's own validators: allowed characters and maximum length.
            field = user_model._meta.get_field(user_model.USERNAME_FIELD)
            if isinstance(field, models.Field):
                field.run_validators(username)
        except ValidationError as error:
            raise CommandError(
                f"{username!r} is not a valid username: {error.messages[0]}"
            ) from None
        if Agent.objects.filter(user__username=username).exists():
            # An agent's user acts through the API; giving it review rights would let an
            # agent approve its own steps.
            raise CommandError(f"{username!r} is an agent's user; choose another username")

        existed = user_model.objects.filter(username=username).exists()
        new_workspace = not Workspace.objects.filter(slug=slug).exists()
        with transaction.atomic():
            workspace = workspace_get_or_create(slug=slug)
            reviewer_create(workspace=workspace, username=username, password=password)

        self.stdout.write(
            f"{'Updated existing' if existed else 'Created'} user {username!r}; granted "
            f"{', '.join(REVIEWER_PERMISSIONS)} on {'new' if new_workspace else 'existing'} "
            f"workspace {workspace.slug!r}."
        )
        if password:
            self.stdout.write("Password set.")
        elif not existed:
            self.stdout.write(
                f"No password set: the user cannot log in until one is "
                f"(manage.py changepassword {username})."
            )
