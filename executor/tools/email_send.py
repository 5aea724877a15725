"""`email.send`: one message through Django's email backend; irreversible, not idempotent."""

from __future__ import annotations

import contextlib
import smtplib

from django.conf import settings
from django.core import mail
from django.core.exceptions import ValidationError
from django.core.validators import validate_email

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    FailureClass,
    Idempotency,
    Invocation,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    register,
)


@register
class EmailSend(Tool):
    name = "email.send"
    description = "Sends one plain-text email. Irreversible: a sent email cannot be unsent."
    effect = Effect.WRITE
    # SMTP has no idempotency key: a server that accepted the message may still drop the
    # connection before saying so, and sending again would deliver it twice.
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.BY_POLICY
    compensation = ""
    retry = RetryPolicy(initial_interval=2, max_interval=60, max_attempts=5, deadline=900)
    input_schema = {
        "type": "object",
        "properties": {
            "to": {"type": "string", "maxLength": 254, "pattern": "^[^@\\s]+@[^@\\s]+$"},
            "subject": {"type": "string", "maxLength": 200, "pattern": "^[^\\r\\n]*$"},
            "body": {"type": "string", "maxLength": 100_000},
        },
        "required": ["to", "subject", "body"],
        "additionalProperties": False,
    }

    def invoke(self, call: Invocation) -> ToolResult:
        errors = self.validate_input(call.input)
        if errors:
            raise ToolError(FailureClass.INVALID_INPUT, "; ".join(errors))
        to = call.input["to"]
        try:
            validate_email(to)
        except ValidationError as error:
            raise ToolError(FailureClass.INVALID_INPUT, f"invalid address {to!r}") from error
        # Stable across attempts, so a receiver (or a person) can recognize a duplicate.
        message_id = f"<{call.operation_id}@stepward>"
        message = _build_message(call, to=to, message_id=message_id)
        try:
            # Building the MIME message is where header injection and bad addresses show
            # up, before any connection is made.
            message.message()
        except ValueError as error:
            raise ToolError(FailureClass.INVALID_INPUT, str(error)) from error

        connection = mail.mailers.default
        try:
            connection.open()
        except smtplib.SMTPAuthenticationError as error:
            raise ToolError(
                FailureClass.PERMISSION_DENIED, f"mail login refused: {error}"
            ) from error
        except OSError as error:
            # smtplib's errors are OSErrors too; none of them can follow the message data.
            raise ToolError(
                FailureClass.TRANSIENT, f"mail server unreachable, nothing was sent: {error}"
            ) from error
        try:
            sent = connection.send_messages([message])
        except smtplib.SMTPRecipientsRefused as error:
            # Every recipient was refused before DATA: the server accepted nothing.
            raise ToolError(FailureClass.INVALID_INPUT, f"recipient refused: {error}") from error
        except Exception as error:
            raise ToolError(
                FailureClass.AMBIGUOUS,
                f"the message may have been sent: {type(error).__name__}: {error}",
                evidence={"message_id": message_id, "error": type(error).__name__},
            ) from error
        finally:
            # A failure to say goodbye changes nothing about what was sent.
            with contextlib.suppress(Exception):
                connection.close()
        if sent != 1:
            raise ToolError(FailureClass.INVALID_INPUT, "the backend sent nothing")
        return ToolResult(
            result={"sent": True, "message_id": message_id},
            external_id=message_id,
            evidence={"message_id": message_id, "to": to, "backend": type(connection).__name__},
        )


def _build_message(call: Invocation, *, to: str, message_id: str) -> mail.EmailMessage:
    return mail.EmailMessage(
        subject=call.input["subject"],
        body=call.input["body"],
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=[to],
        headers={"Message-ID": message_id},
    )
