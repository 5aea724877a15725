"""`manage.py verify_ledger [--step UUID] [--since N] [--against FILE] [--checkpoint]
[--archive PATH]`: the ledger's tamper evidence (DESIGN.md §15), or an archive's."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.ledger import chain, retention
from executor.ledger.records import Step


class Command(BaseCommand):
    help = (
        "Verifies every step's event hash chain against its step row, approvals and attempts, "
        "every run's events and budget, the runs' numbering and the signed checkpoints "
        "(DESIGN.md §15); names each break and exits non-zero when anything is broken. "
        "--checkpoint then signs a new checkpoint."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--step", help="verify only this step's chain (its UUID)")
        parser.add_argument(
            "--chunk-size",
            type=int,
            default=chain.DEFAULT_CHUNK_SIZE,
            help=f"steps read per round trip (default {chain.DEFAULT_CHUNK_SIZE})",
        )
        parser.add_argument(
            "--since",
            type=int,
            metavar="N",
            help="verify incrementally: what changed since checkpoint N (the newest one a full "
            "verification passed), and the checkpoints from N on",
        )
        parser.add_argument(
            "--against",
            metavar="FILE",
            help="checkpoint heads kept outside the database (EXECUTOR_CHECKPOINT_EXPORT's file, "
            "or logs holding the 'checkpoint signed' lines): each must still be in the database",
        )
        parser.add_argument(
            "--archive",
            metavar="PATH",
            help="verify an archive of archive_runs instead of the database: a .jsonl.gz file, "
            "its manifest, or a folder of them (the chains in it, its signature, and the "
            "digest this database's checkpoints recorded for each of its runs)",
        )
        parser.add_argument(
            "--checkpoint",
            action="store_true",
            help="after a clean verification, sign a checkpoint of where every chain stands",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["chunk_size"] < 1:
            raise CommandError("--chunk-size must be at least 1")
        if options["archive"]:
            self.verify_archives(Path(options["archive"]))
            return
        if options["step"]:
            try:
                step_id = uuid.UUID(options["step"])
            except ValueError:
                raise CommandError(f"--step: {options['step']!r} is not a UUID") from None
            if not Step.objects.filter(pk=step_id).exists():
                raise CommandError(f"no step {step_id}")
            report = chain.verify_chain(step_ids=[step_id], chunk_size=options["chunk_size"])
        else:
            against: list[tuple[int, str]] = []
            if options["against"]:
                try:
                    against = chain.read_exported(options["against"])
                except (OSError, ValueError) as error:
                    raise CommandError(f"--against: {error}") from None
                if not against:
                    raise CommandError(
                        f"--against: {options['against']} holds no exported checkpoint head"
                    )
            try:
                report = chain.verify_ledger(
                    chunk_size=options["chunk_size"], since=options["since"], against=against
                )
            except chain.NoSuchCheckpoint as error:
                raise CommandError(f"--since: {error}") from None
        for finding in report.findings:
            self.stdout.write(self.style.ERROR(str(finding)))
        summary = report.summary()
        if not report.ok:
            self.stdout.write(summary)
            raise CommandError(f"the ledger is broken: {len(report.findings)} break(s) found")
        self.stdout.write(self.style.SUCCESS(summary))
        if options["step"]:
            return
        if options["checkpoint"]:
            report.newest_checkpoint = chain.checkpoint_take() or report.newest_checkpoint
        self.stdout.write(chain.describe(report.newest_checkpoint))

    def verify_archives(self, path: Path) -> None:
        if not path.exists():
            raise CommandError(f"--archive: {path} does not exist")
        files = retention.archive_files(path)
        if not files:
            raise CommandError(f"--archive: {path} holds no archive (*.jsonl.gz)")
        broken = 0
        for file in files:
            try:
                report = retention.verify_archive(file)
            except retention.ArchiveError as error:
                raise CommandError(f"--archive: {error}") from None
            for finding in report.findings:
                self.stdout.write(self.style.ERROR(f"{file.name}: {finding}"))
            broken += len(report.findings)
            line = f"{file.name}: {report.summary()}"
            self.stdout.write(
                self.style.ERROR(line) if report.findings else self.style.SUCCESS(line)
            )
        if broken:
            raise CommandError(f"the archive is broken: {broken} break(s) found")
