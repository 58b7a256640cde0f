"""SQL over a run's Delta tables with duckdb (``treadle sql``).

duckdb's own extension download needs the internet, so the ``delta`` and ``httpfs``
extensions are loaded by file path from their PyPI wheels (``duckdb-extension-delta``,
``duckdb-extension-httpfs``). Every table of the run is a view of the same name (empty, with
the table's columns, until the run first writes it); a column added to a table's schema since
the run wrote the table reads as null, as ``Tables.read`` gives it, until its next append adds it.
"""

from __future__ import annotations

import glob
import os

from storage.config import S3_SCHEMES, RunStore
from storage.tables import TABLE_SCHEMAS, Tables


def extension_paths() -> list[str]:
    """Files of the httpfs and delta extensions shipped in their wheels."""
    import duckdb_extension_delta
    import duckdb_extension_httpfs

    paths = []
    for package in (duckdb_extension_httpfs, duckdb_extension_delta):
        found = glob.glob(
            os.path.join(os.path.dirname(package.__file__), "extensions", "*", "*.duckdb_extension")
        )
        if not found:
            raise RuntimeError(f"no duckdb extension file inside {package.__name__}")
        paths.append(found[0])
    return paths


def connect(store: RunStore):
    """A duckdb connection with one view per table of the run."""
    import duckdb

    # a persistent secret of the user's (~/.duckdb/stored_secrets) scoped to the run's bucket
    # would win over the run's own, sending the queries to its endpoint with its credentials;
    # a name that is no table would be looked up among the variables of the querying code
    connection = duckdb.connect(
        config={"allow_persistent_secrets": False, "python_enable_replacements": False}
    )
    for path in extension_paths():
        connection.execute(f"LOAD {_literal(path)}")
    config = store.config
    if config.is_s3:
        options = config.delta_options()
        credentials = (
            options.get("AWS_ACCESS_KEY_ID", ""),
            options.get("AWS_SECRET_ACCESS_KEY", ""),
            options.get("AWS_SESSION_TOKEN", ""),
        )
        if not credentials[0]:
            credentials = role_credentials()
        url = config.endpoint() or ""
        endpoint = url.removeprefix("http://").removeprefix("https://")
        connection.execute(
            "CREATE SECRET (TYPE s3, KEY_ID ?, SECRET ?, SESSION_TOKEN ?, REGION ?, ENDPOINT ?, "
            "URL_STYLE 'path', USE_SSL ?)",
            [
                *credentials,
                options["AWS_REGION"],
                endpoint or "s3.amazonaws.com",
                not url.startswith("http://"),
            ],
        )
    tables = Tables(store)
    for name, schema in TABLE_SCHEMAS.items():
        present = tables.columns(name)
        if present is None:  # not written yet (a new run): empty, so queries over it answer rather than fail
            connection.register(name, schema.empty_table())
            continue
        canonical = connection.from_arrow(schema.empty_table())
        added = "".join(
            f", CAST(NULL AS {kind}) AS {_identifier(column)}"
            for column, kind in zip(canonical.columns, canonical.types, strict=True)
            if column not in present
        )
        scan = f"delta_scan({_literal(_delta_scan_url(tables.uri(name)))})"
        connection.execute(f"CREATE VIEW {name} AS SELECT *{added} FROM {scan}")
    return connection


ROLE_PROVIDERS = ("assume-role-with-web-identity", "container-role", "iam-role")
"""botocore's credential providers of a machine's role, those deltalake falls back on when the
run's config and the environment give no key: a pod's web identity, a container's (ECS, EKS)
or the instance's role."""


def role_credentials() -> tuple[str, str, str]:
    """Key id, secret and session token of the machine's role, or empty ones when it has none.
    duckdb signs nothing with an S3 secret whose key is empty: given one, a run that deltalake
    reads with the role's credentials refused the views' requests. Raises ``OSError`` when the
    role's credentials endpoint fails or is not one botocore asks, or ``AWS_PROFILE`` names a
    profile the AWS config lacks."""
    import botocore.credentials
    import botocore.exceptions
    import botocore.session

    try:
        resolver = botocore.credentials.create_credential_resolver(botocore.session.get_session())
        found = botocore.credentials.CredentialResolver(
            [provider for provider in resolver.providers if provider.METHOD in ROLE_PROVIDERS]
        ).load_credentials()
    # ValueError: an AWS_CONTAINER_CREDENTIALS_FULL_URI botocore refuses to ask
    except (botocore.exceptions.BotoCoreError, ValueError) as exc:
        raise OSError(f"cannot get the credentials of the machine's role: {exc}") from None
    if found is None:
        return "", "", ""
    frozen = found.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token or ""


def _delta_scan_url(url: str) -> str:
    """``url`` as the delta extension reads it: it hands the S3 secret only to ``s3://``
    paths, so a table under an ``s3a://`` root is named by the same object's ``s3://`` URL."""
    scheme, sep, rest = url.partition("://")
    return f"s3://{rest}" if sep and scheme in S3_SCHEMES else url


def _identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    """``text`` as a SQL string literal (a path may hold a quote)."""
    return "'" + text.replace("'", "''") + "'"
