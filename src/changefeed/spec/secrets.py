"""Secrets in URIs and client settings: named by reference, or kept encrypted, never stored plain.

A URI (or a setting in a `kafka_config` file) may name a secret by reference, `${VAR}`: the
environment variable's value is put in where the secret is used, when it is used (`resolve`).
A password left out of a PostgreSQL URI is looked up by libpq itself (`~/.pgpass`, `PGPASSFILE`,
a service file). What changefeed stores and hands on (`feed.json`, Spark's options and plans,
messages) is the text as given, references included.

A secret written into a URI as it is (a password in its user part, a query setting whose name
says password, secret, token or key, a webhook header, a signing secret) is replaced before the
feed is stored by `${enc.TOKEN}`: the value encrypted (Fernet: AES-128-CBC and HMAC-SHA256) with a
key kept outside the state folder, readable by its owner only (`~/.config/changefeed/secret.key`,
or the file `CHANGEFEED_SECRET_KEY_FILE` names, or the key itself in `CHANGEFEED_SECRET_KEY`).
So nothing under the state folder holds a secret in plain text, and a copy of the folder alone
does not give one away.
"""
from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from changefeed.errors import ConfigError

if TYPE_CHECKING:
    from cryptography.fernet import Fernet

KEY_ENV, KEY_FILE_ENV = "CHANGEFEED_SECRET_KEY", "CHANGEFEED_SECRET_KEY_FILE"
_REF = re.compile(r"\$\{(?:enc\.([A-Za-z0-9_=-]+)|([A-Za-z_][A-Za-z0-9_]*))\}")
# a query setting is secret when its name says so (libpq's password, librdkafka's sasl.password,
# ssl.key.password, sasl.oauthbearer.client.secret, object stores' secret keys and tokens, ...)
_SECRET_NAME = re.compile(r"passw(or)?d|secret|token|(access|account|private|sas)_?key|\bsas\b|credential|^header$",
                          re.I)


def secret_name(name: str) -> bool:
    """Whether a setting called `name` holds a secret."""
    return bool(_SECRET_NAME.search(name))


def resolve(text: str, option: str, *, in_uri: bool = False) -> str:
    """`text` with every reference replaced by its value (percent-encoded `in_uri`, where it goes
    into a URI); ConfigError naming `option` for a variable that is not set or a token this key
    cannot read. Never puts a value in a message."""
    if "${" not in text:
        return text

    def value(m: re.Match[str]) -> str:
        token, var = m.group(1), m.group(2)
        if var is not None:
            if var not in os.environ:
                raise ConfigError(f"{option} names the environment variable {var} (${{{var}}}), which is not set",
                                  f"export {var}=... in the environment that runs changefeed (and its Spark "
                                  "executors), or write the value in the option")
            got = os.environ[var]
        else:
            got = _decrypt(token, option)
        return quote(got, safe="") if in_uri else got

    return _REF.sub(value, text)


def check(text: str, option: str) -> None:
    """Raise what `resolve` would (before anything is created)."""
    resolve(text, option)


def protect_uri(uri: str, option: str) -> str:
    """`uri` as it may be stored: a literal password in its user part and every literal secret
    query setting (a `kafka_config` JSON object's secret settings too) encrypted."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if parts.password is not None and not _is_ref(parts.password):
        user, _, host = netloc.rpartition("@")
        name, _, _ = user.partition(":")
        netloc = f"{name}:{encrypt(unquote(parts.password))}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        protected = [(k, _protect_value(k, v)) for k, v in pairs]
        if protected != pairs:
            query = urlencode(protected, safe="${}.:/@,[]=")  # (= pads a token)
    if netloc == parts.netloc and query == parts.query:
        return uri
    # rebuilt by hand: urlunsplit drops the empty authority of `delta:///path`
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "") + fragment


def _protect_value(name: str, value: str) -> str:
    if name == "kafka_config" and value.lstrip().startswith("{"):
        try:
            settings = json.loads(value)
        except ValueError:
            return value  # (the sink's own parsing says what is wrong with it)
        if isinstance(settings, dict):
            return json.dumps({k: encrypt(v) if secret_name(k) and isinstance(v, str) and not _is_ref(v) else v
                               for k, v in settings.items()}, separators=(",", ":"))
    if name == "header":  # NAME:VALUE, only the value secret
        header, sep, rest = value.partition(":")
        rest = rest.strip()
        return f"{header}:{encrypt(rest)}" if sep and rest and not _is_ref(rest) else value
    return encrypt(value) if secret_name(name) and value and not _is_ref(value) else value


def _is_ref(value: str) -> bool:
    """Whether `value` names its secret by reference (a value that names one is left as written)."""
    return bool(_REF.search(value))


def references(text: str) -> list[str]:
    """The environment variables `text` names."""
    return [m.group(2) for m in _REF.finditer(text) if m.group(2)]


def encrypt(value: str) -> str:
    """`value` as `${enc.TOKEN}`."""
    return "${enc." + _fernet(create=True).encrypt(value.encode()).decode("ascii") + "}"


def _decrypt(token: str, option: str) -> str:
    from cryptography.fernet import InvalidToken

    try:
        return _fernet(create=False).decrypt(token.encode("ascii")).decode()
    except (InvalidToken, ValueError):
        raise ConfigError(f"{option} holds a secret encrypted with another key than {key_source()}",
                          "give the secret again (or by reference, ${VAR}) with changefeed run --name NAME "
                          f"--source/--sink ..., or restore the key ({KEY_FILE_ENV} / {KEY_ENV})") from None


def key_source() -> str:
    return f"${KEY_ENV}" if os.environ.get(KEY_ENV) else str(key_path())


def key_path() -> Path:
    return Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".config" / "changefeed" / "secret.key")


def key_value() -> str | None:
    """The key's text, if there is one (what Spark executors on other hosts are given)."""
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV]
    try:
        return key_path().read_text().strip()
    except OSError:
        return None


def _fernet(create: bool) -> Fernet:
    from cryptography.fernet import Fernet

    text = key_value()
    if text is None:
        if not create:
            raise ConfigError(f"the key that encrypted the stored secrets is missing ({key_source()})",
                              "give the secrets again (or by reference, ${VAR}), or restore the key file")
        text = _new_key(Fernet.generate_key().decode("ascii"))
    return Fernet(text.encode("ascii"))


def _new_key(text: str) -> str:
    """Write a new key file, readable by its owner only (never replacing one)."""
    path = key_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()  # another process made it first
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return text


def loose(path: Path) -> str | None:
    """`rwxr-x---`-style mode of `path` if users other than its owner may read or enter it, else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return stat.filemode(mode)[1:] if mode & (stat.S_IRWXG | stat.S_IRWXO) else None


def mapped(settings: dict[str, str], option: Callable[[str], str]) -> dict[str, str]:
    """Client settings with their references resolved (`option(name)` names one in errors)."""
    return {k: resolve(v, option(k)) for k, v in settings.items()}


def same(given: str, stored: str, option: str) -> bool:
    """Whether a URI given again names what the stored one does (a literal secret stored encrypted)."""
    return given == stored or resolve(given, option) == resolve(stored, option)


def executor_env(uris: list[str]) -> dict[str, str]:
    """What Spark executors on other hosts need to resolve `uris`: the variables they name, and
    the key when a secret in them is stored encrypted."""
    env = {var: os.environ[var] for uri in uris for var in references(uri) if var in os.environ}
    if any("${enc." in uri for uri in uris) and (key := key_value()):
        env[KEY_ENV] = key
    return env


def passfile_problem() -> str | None:
    """Why libpq would not use its password file (PGPASSFILE, else ~/.pgpass), if it would not."""
    named = os.environ.get("PGPASSFILE")
    path = Path(named) if named else Path.home() / ".pgpass"
    if not path.exists():
        return f"the password file {path} (PGPASSFILE) does not exist" if named else None
    if not os.access(path, os.R_OK):
        return f"the password file {path} cannot be read"
    mode = loose(path)
    return f"libpq skips the password file {path}: others may read it ({mode}); chmod 0600 it" if mode else None
