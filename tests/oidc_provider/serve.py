"""Runs the test provider: migrates its database, registers the console as a client, serves.

    python -m tests.oidc_provider.serve --port P --db FILE --key FILE \\
        --redirect-uri URI --client-id ID --client-secret SECRET

`OIDC_PROVIDER_CONTROL_TOKEN` guards the control endpoint the tests use to add people.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for name in ("port", "db", "key", "redirect-uri", "client-id", "client-secret"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args(argv)
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.oidc_provider.settings"
    os.environ["OIDC_PROVIDER_DB"] = args.db
    os.environ["OIDC_PROVIDER_KEY"] = args.key
    os.environ["OIDC_PROVIDER_ISSUER"] = f"http://127.0.0.1:{args.port}/o"

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)

    from django.core.servers.basehttp import run
    from django.core.wsgi import get_wsgi_application
    from oauth2_provider.models import get_application_model

    application = get_application_model()
    application.objects.filter(client_id=args.client_id).delete()
    application.objects.create(
        name="Stepward",
        client_id=args.client_id,
        client_secret=args.client_secret,
        client_type=application.CLIENT_CONFIDENTIAL,
        authorization_grant_type=application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=args.redirect_uri,
        algorithm=application.RS256_ALGORITHM,
        skip_authorization=True,
    )
    run("127.0.0.1", int(args.port), get_wsgi_application(), threading=True)


if __name__ == "__main__":
    main(sys.argv[1:])
