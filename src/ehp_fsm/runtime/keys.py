"""CURVE key files for the control plane: generate them (`ehp-fsm keys DIR`) and load them.

Knows: the directory layout, file permissions, and how to read pyzmq certificate files
(`zmq.auth.create_certificates` writes them; they are read as
`zmq.auth.load_certificate` reads them, secret ones without following a link).

    DIR/                          0700
      controller.key              controller public key (copy to every agent host)
      controller.key_secret       controller keypair, 0600 (stays on the controller host)
      hosts.json                  the binding {host id: its agent's public key (Z85)}: a key
                                  is accepted only for the host id it was made for
      authorized/<agent>.key      public keys the controller accepts (ZAP allow-list)
      agents/                     0700
        <agent>.key               agent public key
        <agent>.key_secret        agent keypair, 0600 (copy to the hosts that run that agent)

Each agent name is a host id (`ehp-fsm keys DIR --agent HOST ...`). Does not know: sockets
(`transport` applies the keys and checks the binding on every frame), or how keys reach other
hosts — carry `controller.key` and one `agents/<agent>.key_secret` to each node by your
cluster's means.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import zmq
import zmq.auth

from ehp_fsm.fspaths import write_whole
from ehp_fsm.runtime.errors import KeyFileError

CONTROLLER_NAME: Final = "controller"
DEFAULT_AGENT_NAME: Final = "agent"
HOSTS_FILE: Final = "hosts.json"
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")  # `$` took "h2\n"


@dataclass(frozen=True, kw_only=True)
class CurveServerKeys:
    """What the controller's ROUTER needs: its keypair, the directory of accepted clients, and
    the binding of each host id to the one public key (Z85 text) that may speak for it."""

    public: bytes
    secret: bytes
    authorized_dir: Path
    hosts: Mapping[str, str]

    def __post_init__(self) -> None:
        _check_z85(self.public, "controller public key")
        _check_z85(self.secret, "controller secret key")
        for host, key in self.hosts.items():
            _check_name(host)
            _check_z85(key.encode("ascii"), f"the key bound to host {host}")
        if not self.authorized_dir.is_dir():
            raise KeyFileError(
                f"authorized-keys directory {self.authorized_dir} does not exist",
                "the controller accepts only agents whose public key is in it",
                "run `ehp-fsm keys DIR` and point at DIR/authorized",
            )


@dataclass(frozen=True, kw_only=True)
class CurveClientKeys:
    """What an agent's DEALER needs: its keypair and the controller's public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    def __post_init__(self) -> None:
        _check_z85(self.public, "agent public key")
        _check_z85(self.secret, "agent secret key")
        _check_z85(self.server_public, "controller public key")


@dataclass(frozen=True, kw_only=True)
class KeyLayout:
    """Where `generate_keys` put everything."""

    root: Path
    controller_public: Path
    controller_secret: Path
    authorized_dir: Path
    agent_secrets: dict[str, Path]

    def describe(self) -> str:
        """What `ehp-fsm keys DIR` prints: where each file is and where it must go."""
        lines = [
            f"controller keypair: {self.controller_secret} (0600, stays on the controller host)",
            f"controller public key: {self.controller_public} (copy to every agent host)",
            f"authorized agent keys: {self.authorized_dir}/",
        ]
        lines += [
            f"agent {name!r} keypair: {path} (0600, copy to the hosts running agent {name!r})"
            for name, path in sorted(self.agent_secrets.items())
        ]
        # a plan's relative paths start at the plan's folder, not here: name the folder whole
        lines.append(f'in the plan: [transport] curve_keys = "{self.root.absolute()}"')
        return "\n".join(lines)


def _check_z85(key: bytes, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != 40:
        raise KeyFileError(
            f"{what} is not a 40-character Z85 CURVE key",
            "CURVE keys are 32 bytes, Z85-encoded to 40 characters",
            "regenerate the keys with `ehp-fsm keys DIR`",
        )


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name) or name == CONTROLLER_NAME:
        raise KeyFileError(
            f"agent key name {name!r} is invalid",
            "it becomes a file name; `controller` is reserved",
            "use letters, digits, '.', '_' or '-' (at most 64 characters)",
        )


def generate_keys(
    directory: str | os.PathLike[str],
    *,
    agents: Sequence[str] = (DEFAULT_AGENT_NAME,),
    overwrite: bool = False,
) -> KeyLayout:
    """Create the controller keypair and one keypair per agent name under `directory`.

    Secret files are 0600 inside 0700 directories. Refuses to replace existing keys unless
    `overwrite` (replacing keys locks out every agent still holding the old ones).
    """
    if not zmq.has("curve"):
        raise KeyFileError(
            "this libzmq has no CURVE support",
            "pyzmq was built against a libzmq without libsodium/tweetnacl",
            "install the pyzmq wheel from PyPI, which bundles CURVE",
        )
    if not agents:
        raise KeyFileError("no agent names given", "every agent needs a keypair", "pass one name")
    for name in agents:
        _check_name(name)
    if len(set(agents)) != len(agents):
        raise KeyFileError("agent names repeat", "each name is one key file", "list each once")
    root = Path(directory)
    controller_secret = root / f"{CONTROLLER_NAME}.key_secret"
    if controller_secret.exists() and not overwrite:
        raise KeyFileError(
            f"keys already exist in {root}",
            "new keys would lock out every agent still holding the old ones",
            "use another directory, or replace them deliberately (`ehp-fsm keys --force`; "
            "`overwrite=True` from Python)",
        )
    agents_dir, authorized = root / "agents", root / "authorized"
    try:
        for path in (root, agents_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.chmod(0o700)  # secrets are written into these before their own chmod
        authorized.mkdir(mode=0o755, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only file system
        raise KeyFileError(
            f"cannot make the key directory {root}",
            f"{type(exc).__name__}: {exc.strerror or exc}",
            "give a directory path that can be created (not an existing file)",
        ) from None
    if overwrite:
        for stale in authorized.glob("*.key"):
            stale.unlink()
    public, secret = zmq.auth.create_certificates(root, CONTROLLER_NAME)
    Path(secret).chmod(0o600)
    agent_secrets: dict[str, Path] = {}
    bound: dict[str, str] = {}
    for name in agents:
        agent_public, agent_secret = zmq.auth.create_certificates(agents_dir, name)
        Path(agent_secret).chmod(0o600)
        shutil.copyfile(agent_public, authorized / f"{name}.key")
        agent_secrets[name] = Path(agent_secret)
        bound[name] = zmq.auth.load_certificate(agent_public)[0].decode("ascii")
    write_whole(root / HOSTS_FILE, json.dumps(bound, indent=2, sort_keys=True) + "\n")
    return KeyLayout(
        root=root,
        controller_public=Path(public),
        controller_secret=Path(secret),
        authorized_dir=authorized,
        agent_secrets=agent_secrets,
    )


def _load(path: Path, *, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists() and not (need_secret and path.is_symlink()):
        raise KeyFileError(
            f"key file {path} does not exist",
            "CURVE needs the files `ehp-fsm keys DIR` writes",
            "run `ehp-fsm keys DIR`, or copy the file from the host that generated the keys",
        )
    if need_secret:
        text = _read_private(path, _SECRET_KEY)
    elif not path.is_file():  # a FIFO would block the read
        raise KeyFileError(
            f"key file {path} is not a regular file",
            "a key is one file `ehp-fsm keys DIR` writes",
            f"put the key file itself at {path}",
        )
    else:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise KeyFileError(
                f"key file {path} cannot be read", str(exc), "regenerate it with `ehp-fsm keys DIR`"
            ) from exc
    public, secret = _certificate(text)
    if public is None:
        raise KeyFileError(
            f"key file {path} cannot be read",
            "it holds no public key",
            "regenerate it with `ehp-fsm keys DIR`",
        )
    if need_secret and secret is None:
        raise KeyFileError(
            f"key file {path} has no secret key",
            "it is a public certificate",
            "point at the `.key_secret` file",
        )
    return public, secret


@dataclass(frozen=True)
class _Private:
    """What to say when a private file (a CURVE secret key, the engines' API key) is refused:
    its name in messages, why each refusal matters, and what to do."""

    label: str  # "secret key file", "the engines' API key"
    link_why: str
    link_fix: str  # {path} is the file
    owner_why: str
    owner_fix: str  # {path}, {uid}
    others_why: str
    read_fix: str
    regular_why: str


def _read_private(file: Path, kind: _Private) -> bytes:
    """The bytes of private file `file`: refused when it is a symbolic link, not a regular file,
    another user's, or readable by other users.

    Its folder may be one others reach (a cluster's shared `curve_keys`): a link planted there
    was followed, and a file of the user's from elsewhere (another keypair, a token) became the
    key; a 0600 file of another user's (which root reads) was taken, and that user knows the
    secret. The file is opened without following a link and its owner and mode are those of the
    open file (no swap between check and read)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP and file.is_symlink():
            raise KeyFileError(
                f"{kind.label} {file} is a symbolic link (to {os.readlink(file)})",
                kind.link_why,
                kind.link_fix.format(path=file),
            ) from None
        raise KeyFileError(
            f"{kind.label} {file} cannot be read", f"{type(exc).__name__}: {exc}", kind.read_fix
        ) from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(
                f"{kind.label} {file} is not a regular file",
                kind.regular_why,
                f"put the file itself at {file}",
            )
        if st.st_uid != os.geteuid():
            raise KeyFileError(
                f"{kind.label} {file} is owned by another user (uid {st.st_uid})",
                kind.owner_why,
                kind.owner_fix.format(path=file, uid=os.geteuid()),
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise KeyFileError(
                f"{kind.label} {file} is readable by other users",
                kind.others_why,
                f"run `chmod 600 {file}`",
            )
        try:
            return fh.read()
        except OSError as exc:
            raise KeyFileError(
                f"{kind.label} {file} cannot be read", f"{type(exc).__name__}: {exc}", kind.read_fix
            ) from None


_SECRET_KEY: Final = _Private(
    label="secret key file",
    link_why="a secret key is read from the file itself: through a link, any keypair file "
    "(another cluster's, another user's) would become the key this side authenticates with",
    link_fix="remove the link ({path}) and copy the key file there itself",
    owner_why="whoever owns a secret key file knows the key, and can speak as this side",
    owner_fix="regenerate the keys (`ehp-fsm keys DIR`), or `chown` it to uid {uid} if it is "
    "the key you meant",
    others_why="anyone who reads it can impersonate this side of the control plane",
    read_fix="regenerate it with `ehp-fsm keys DIR`",
    regular_why="a secret key is one file `ehp-fsm keys DIR` writes",
)


def _certificate(text: bytes) -> tuple[bytes | None, bytes | None]:
    """(public, secret) keys of a pyzmq certificate file's bytes (`zmq.auth.load_certificate`'s
    reading, which takes a path: the bytes are read once, from the checked open file)."""
    public: bytes | None = None
    secret: bytes | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(b"#"):
            continue
        if line.startswith(b"public-key"):
            public = line.partition(b"=")[2].strip(b" \t'\"")
        if line.startswith(b"secret-key"):
            secret = line.partition(b"=")[2].strip(b" \t'\"")
        if public and secret:
            break
    return public, secret


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) from one `.key_secret` file: refused when missing, unreadable, readable
    by other users, or a public certificate only (what a process handed one key file uses)."""
    public, secret = _load(Path(path), need_secret=True)
    assert secret is not None
    return public, secret


def load_server_keys(directory: str | os.PathLike[str]) -> CurveServerKeys:
    """The controller's keys from a `generate_keys` directory."""
    root = Path(directory)
    public, secret = _load(root / f"{CONTROLLER_NAME}.key_secret", need_secret=True)
    assert secret is not None
    return CurveServerKeys(
        public=public,
        secret=secret,
        authorized_dir=root / "authorized",
        hosts=load_host_binding(root),
    )


def load_host_binding(root: Path) -> dict[str, str]:
    """`DIR/hosts.json`: {host id: the Z85 public key that may speak for it}."""
    path = root / HOSTS_FILE
    fix = "regenerate the keys with `ehp-fsm keys DIR --agent HOST ...` (one per host id)"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KeyFileError(
            f"host binding {path} does not exist",
            "without it any authorized key could speak for any host id",
            fix,
        ) from None
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"host binding {path} cannot be read", str(exc), fix) from None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 40 for k, v in doc.items()
    ):
        raise KeyFileError(
            f"host binding {path} is malformed",
            "it must map each host id to a 40-character Z85 public key",
            fix,
        )
    return doc


def client_key_file(directory: str | os.PathLike[str], agent: str = DEFAULT_AGENT_NAME) -> Path:
    """Agent `agent`'s secret key file in a key directory (the pool workers an agent launches
    authenticate with it too)."""
    _check_name(agent)
    return Path(directory) / "agents" / f"{agent}.key_secret"


def load_client_keys(
    directory: str | os.PathLike[str], agent: str = DEFAULT_AGENT_NAME
) -> CurveClientKeys:
    """Agent `agent`'s keys (and the controller's public key) from a key directory."""
    _check_name(agent)
    root = Path(directory)
    public, secret = _load(client_key_file(root, agent), need_secret=True)
    server_public, _ = _load(root / f"{CONTROLLER_NAME}.key", need_secret=False)
    assert secret is not None
    return CurveClientKeys(public=public, secret=secret, server_public=server_public)


# -- the engines' HTTP API key ---------------------------------------------------------------
#: The file of a run's engine API key, beside the CURVE keys (`engines.engine_key_file`).
API_KEY_FILE: Final = "engine-api-key"


def ensure_api_key(path: str | os.PathLike[str]) -> str:
    """The engines' API key in `path`: read when the file exists (a cluster's shared key
    directory), else a fresh random one written there (0600, in a 0700 directory, created
    exclusively: two writers never leave two keys)."""
    file = Path(path)
    if not file.exists():
        try:
            file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return read_api_key(file)  # another writer made it first
        except OSError as exc:
            raise KeyFileError(
                f"cannot write the engines' API key {file}",
                f"{type(exc).__name__}: {exc.strerror or exc}",
                "give the run a writable key directory ([transport] curve_keys or the run's)",
            ) from None
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
    return read_api_key(file)


_API_KEY: Final = _Private(
    label="the engines' API key",
    link_why="the key is read from the file itself: through a link any file of yours (a token) "
    "would become the key SGLang's command line shows every user",
    link_fix="remove the link ({path}): the next run writes a fresh key",
    owner_why="whoever owns the key file chose the key, and can drive the engines with it",
    owner_fix="remove it (the next run writes a fresh key of yours), or `chown` it to uid {uid} "
    "if it is the key you meant",
    others_why="anyone who reads it can drive the engines (load weights, pause, abort)",
    read_fix="start the run first (it writes the key), or check the path and its permissions",
    regular_why="the key is one line in a file the run writes",
)


def read_api_key(path: str | os.PathLike[str]) -> str:
    """The engines' API key from `path` (what an agent hands the engines it starts): refused
    when missing, empty, or a file `_read_private` refuses (a link, another user's, readable by
    others): the key's folder may be one others reach, and SGLang's command line shows the key
    to every user of the node."""
    file = Path(path)
    try:
        text = _read_private(file, _API_KEY).decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise KeyFileError(
            f"the engines' API key {file} cannot be read",
            f"{type(exc).__name__}: {exc}",
            _API_KEY.read_fix,
        ) from None
    if not text or any(c.isspace() for c in text):
        raise KeyFileError(
            f"the engines' API key {file} is empty or holds spaces",
            "a key is one line of printable characters",
            "remove the file: the next run writes a fresh one",
        )
    return text
