"""The process environment: the one place where offline mode and telemetry opt-outs are set, and
how a credential (in a URL, a message or an environment variable) is masked before it is shown.

Imported first by the package, before transformers, huggingface_hub, prefect or mlflow read
their environment, so no code path ever tries the network for a model hub or telemetry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from urllib.parse import unquote

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Prefect's temporary server can take a minute to start on a busy 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # A tracking server that stops answering mid-run: a few seconds of retries, not MLflow's minutes
    # (its defaults: 7 retries, backoff factor 2, 120 s per request). Reachability is checked first.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def apply_offline_env() -> None:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


# ----------------------------------------------------------------------------------------------
# credentials: how a URL or a message that may carry one is shown

MASK = "***"
# query-string and DSN keys whose value is a credential (`?password=`, `sslpassword=`, `?token=`, ...)
SECRET_KEYS = ("password", "passwd", "pass", "pwd", "sslpassword", "token", "access_token", "auth_token",
               "secret", "client_secret", "key", "api_key", "apikey", "access_key", "secret_key", "signature", "sig")
# environment variables whose value is a credential wherever it appears, besides any whose name says so
SECRET_ENV = ("PGPASSWORD", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "OPENAI_API_KEY", "HF_TOKEN",
              "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCESS_KEY")
URL_ENV = ("SPECDISTILL_LOG_DB", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_API_DATABASE_CONNECTION_URL",
           "PREFECT_API_URL")
_SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|TOKEN|SECRET|API_KEY|ACCESS_KEY)$")
_MIN_LITERAL = 4  # a shorter secret is masked where it stands in a URL, not wherever its letters occur

# scheme://user:PASSWORD@host, as the drivers read it: the userinfo runs to the LAST @ before the host
# (the path, query or a space), the user to its first colon, so an @ in either stays in the credential
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][\w+.-]*://[^\s:/?#]*):(?P<password>[^\s/?#]*)@")
# user:PASSWORD@host with no scheme (`bob:S3CRET@db/logs`, a URL typed without `postgresql://`)
_BARE_USERINFO = re.compile(r"(?<![\w.+%:/@-])(?P<head>[A-Za-z_][\w.+%-]*):(?P<password>[^\s/?#:]+(?:[^\s/?#]*))@"
                            r"(?=[\w\[])")
# key=VALUE in a query string or a libpq DSN ("host=h password=x"), quoted or not
_KEY_VALUE = re.compile(r"(?i)(?<![\w.-])(?P<key>" + "|".join(SECRET_KEYS) + r")(?P<eq>\s*=\s*)"
                        r"(?P<value>'[^']*'|\"[^\"]*\"|[^&\s;,'\")]+)")


# keys that are also plain words ("is not key=value"): a credential only in a query string (`?key=`, `&sig=`)
QUERY_ONLY_KEYS = ("key", "sig", "signature")


def _key_values(text: str) -> list[re.Match]:
    return [m for m in _KEY_VALUE.finditer(text)
            if m.group("key").lower() not in QUERY_ONLY_KEYS or text[max(m.start() - 1, 0):m.start()] in ("?", "&", ";")]


def _credentials(text: str) -> list[str]:
    """The credentials in `text` as they stand in it (a URL's password, a secret key's value)."""
    found = [m.group("password") for m in _USERINFO.finditer(text)]
    found += [m.group("password") for m in _BARE_USERINFO.finditer(_USERINFO.sub("", text))]
    found += [m.group("value").strip("'\"") for m in _key_values(text)]
    return [p for p in found if p and p != MASK and not _SECRET_REF.fullmatch(p)]


def _url_passwords(url: str) -> list[str]:
    return [p for q in _credentials(url) for p in _pieces(q)]


def _pieces(secret: str) -> set[str]:
    """A credential, its percent-decoded form, and what a parser that ends the userinfo at the FIRST @
    makes of it (`p@ssSECRET` is password `p` and host `ssSECRET@...` to SQLAlchemy): each piece after an
    @ is masked wherever it appears, in a driver's "failed to resolve host 'ssSECRET@...'" too."""
    out = set()
    for whole in {secret, unquote(secret)}:
        out.add(whole)
        parts = whole.split("@")
        out.update("@".join(parts[i:]) for i in range(1, len(parts)))
        out.update(parts)
    return {p for p in out if p}


def driver_url(url: str) -> str:
    """`url` with each @ inside its userinfo percent-encoded, so that every parser (SQLAlchemy ends the
    userinfo at the first @, libpq and urllib at the last) reads the same user, password and host: the
    host is never a piece of the password, which an error would then print."""
    m = re.match(r"(?P<scheme>[A-Za-z][\w+.-]*://)(?P<userinfo>[^\s/?#]*)@", url)
    if m is None or "@" not in m.group("userinfo"):
        return url
    return m.group("scheme") + m.group("userinfo").replace("@", "%40") + url[m.end("userinfo"):]


def environment_secrets() -> list[str]:
    """The credentials this process's environment holds (secret variables, passwords inside URL
    variables), longest first: they are masked wherever they appear, not only inside a URL."""
    values = [p for k, v in os.environ.items() if k in SECRET_ENV or _SECRET_NAME.search(k) or k.startswith(SECRET_PREFIX)
              for p in _pieces(v)]
    for key in URL_ENV:
        values += _url_passwords(os.environ.get(key, ""))
    return sorted({v for v in values if len(v) >= _MIN_LITERAL}, key=len, reverse=True)


def mask_secrets(text: str, context: str | None = None) -> str:
    """`text` with every credential replaced by ***: a URL's user:password@ (with or without a scheme),
    a query-string or DSN value under a secret key (password, pwd, token, secret, key, ...), and the
    value of any secret environment variable. `context`: a URL the text is about but may not quote (a
    driver's error about it), whose credentials are masked wherever they appear. Every URL or error
    message that may hold one is shown through this."""
    text = str(text)
    passwords = [p for p in _url_passwords(text) + _url_passwords(context or "") if len(p) >= _MIN_LITERAL]
    text = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    text = _BARE_USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    for m in reversed(_key_values(text)):
        text = f"{text[:m.start()]}{m.group('key')}{m.group('eq')}{MASK}{text[m.end():]}"
    for secret in sorted(set(passwords + environment_secrets()), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


mask_url = mask_secrets  # a URL (database, MLflow, an engine's endpoint) as it may be printed or logged


class MaskingFilter(logging.Filter):
    """Masks credentials in a log record, its message and its traceback, before a handler prints it or
    sends it on (Prefect's flow-run log goes to its database): an exception's text quotes what a driver
    said, which `mask_secrets` alone sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = mask_secrets(record.getMessage()), ()
        if record.exc_info:
            record.exc_text = mask_secrets(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None  # a handler that renders the exception itself (rich) would show it unmasked
        elif record.exc_text:
            record.exc_text = mask_secrets(record.exc_text)
        return True


@contextlib.contextmanager
def masked_logs(prefix: str) -> Iterator[None]:
    """Every handler of the loggers named `prefix...` (and the root's) masks credentials while the block runs."""
    masking = MaskingFilter()
    names = [n for n in list(logging.root.manager.loggerDict) if n == prefix or n.startswith(prefix + ".")]
    handlers = {h for n in names for h in logging.getLogger(n).handlers} | set(logging.root.handlers)
    for handler in handlers:
        handler.addFilter(masking)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(masking)


# ----------------------------------------------------------------------------------------------
# credentials out of a flow's parameters: the command line hands a flow `${SPECDISTILL_SECRET_n}` in
# place of each credential its overrides carry (Prefect stores a flow run's parameters), and keeps the
# value in this process's environment, where config loading finds it again

SECRET_PREFIX = "SPECDISTILL_SECRET_"
_SECRET_REF = re.compile(r"\$\{(" + SECRET_PREFIX + r"\w+)\}")
_stashed: dict[str, str] = {}  # credential -> the variable holding it, one per credential for the process


def stash_secrets(values: list[str]) -> list[str]:
    """`values` (key=value overrides) with every credential replaced by `${SPECDISTILL_SECRET_n}`, the
    credential put in the environment under that name (the same name for the same credential)."""
    out = []
    for value in values:
        for secret in sorted(set(_credentials(value)), key=len, reverse=True):
            name = _stashed.setdefault(secret, f"{SECRET_PREFIX}{len(_stashed) + 1}")
            os.environ[name] = secret
            value = value.replace(secret, "${" + name + "}")
        out.append(value)
    return out


def expand_secrets(text: str) -> str:
    """`text` with each `${SPECDISTILL_SECRET_n}` replaced by its value; `KeyError(name)` for one not set."""
    def value(m: re.Match) -> str:
        if m.group(1) not in os.environ:
            raise KeyError(m.group(1))
        return os.environ[m.group(1)]

    return _SECRET_REF.sub(value, text)
