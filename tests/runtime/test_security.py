"""CURVE keys on disk and mutual authentication over real sockets."""

from __future__ import annotations

import dataclasses
import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ehp_fsm.runtime import (
    Acked,
    AgentEndpoint,
    ControllerEndpoint,
    Dropped,
    KeyFileError,
    LinkChanged,
    Received,
    Replied,
    TransportConfig,
    generate_keys,
    load_client_keys,
    load_server_keys,
)
from ehp_fsm.runtime.keys import CurveClientKeys
from tests.runtime.harness import FakeClock, Loop, auto_reply

CFG = TransportConfig(retry_interval_s=0.2, deadline_s=5.0)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generated_layout_and_permissions(tmp_path: Path) -> None:
    layout = generate_keys(tmp_path / "keys", agents=["node-1", "node-2"])
    root = layout.root
    assert mode(root) == 0o700 and mode(root / "agents") == 0o700
    assert mode(layout.controller_secret) == 0o600
    assert sorted(layout.agent_secrets) == ["node-1", "node-2"]
    for secret in layout.agent_secrets.values():
        assert mode(secret) == 0o600
    assert sorted(p.name for p in layout.authorized_dir.iterdir()) == ["node-1.key", "node-2.key"]
    assert "secret-key" not in (layout.authorized_dir / "node-1.key").read_text()
    text = layout.describe()
    assert str(layout.controller_secret) in text and "node-2" in text
    # the line to paste into a plan names the folder whole (a plan's relative paths start at
    # the plan's folder, not where `ehp-fsm keys` ran)
    assert f'curve_keys = "{(tmp_path / "keys").absolute()}"' in text
    server = load_server_keys(root)
    client = load_client_keys(root, "node-1")
    assert client.server_public == server.public
    assert client.public != load_client_keys(root, "node-2").public


def test_key_generation_refuses_to_clobber_and_bad_names(tmp_path: Path) -> None:
    generate_keys(tmp_path)
    old = load_server_keys(tmp_path).public
    with pytest.raises(KeyFileError, match="already exist") as exists:
        generate_keys(tmp_path)
    # the fix names the command's flag (it said "pass overwrite=True (`--force`)")
    assert "`ehp-fsm keys --force`" in str(exists.value), exists.value
    generate_keys(tmp_path, agents=["b"], overwrite=True)
    assert load_server_keys(tmp_path).public != old
    assert [p.name for p in (tmp_path / "authorized").iterdir()] == ["b.key"]
    for bad in (["../x"], ["controller"], ["a", "a"], []):
        with pytest.raises(KeyFileError):
            generate_keys(tmp_path / "other", agents=bad)
    (tmp_path / "a-file").write_text("")  # a file where the directory would go: no traceback
    with pytest.raises(KeyFileError, match="cannot make the key directory") as err:
        generate_keys(tmp_path / "a-file", agents=["h0"])
    assert "FileExistsError" in err.value.why


def test_loading_refuses_missing_and_world_readable_secrets(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        load_server_keys(tmp_path)
    layout = generate_keys(tmp_path)
    layout.controller_secret.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_server_keys(tmp_path)
    with pytest.raises(KeyFileError, match="40-character"):
        CurveClientKeys(public=b"short", secret=b"x" * 40, server_public=b"x" * 40)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "k", agents=["good"])
    generate_keys(tmp_path / "rogue", agents=["good"])  # same name, keys nobody authorized
    return tmp_path


@pytest.fixture
def secure_ctl(keys: Path) -> Iterator[ControllerEndpoint]:
    with ControllerEndpoint(config=CFG, epoch=1, curve=load_server_keys(keys / "k")) as ctl:
        yield ctl


def _serve_good_agent(ctl: ControllerEndpoint, keys: Path, loop: Loop) -> None:
    agent = AgentEndpoint(
        connect=ctl.endpoint,
        host_id="good",
        config=CFG,
        epoch=1,
        curve=load_client_keys(keys / "k", "good"),
    )
    loop.endpoints.append(agent)
    hello = agent.hello({})
    loop.run_until(lambda: any(a.msg_id == hello for a in loop.of("good", Acked)))
    msg_id = ctl.send_command("good", "launch", {})
    loop.run_until(lambda: any(r.msg_id == msg_id for r in loop.of("controller", Replied)))


def test_the_engines_api_key_is_made_once_private_and_read_back(tmp_path: Path) -> None:
    """The run writes the engines' key (0600 in a 0700 folder) or reads the one already there (a
    cluster's shared key folder); an agent refuses a key file other users can read, an empty
    one, and a missing one, each naming the file and the fix."""
    from ehp_fsm.runtime.keys import ensure_api_key, read_api_key

    path = tmp_path / "keys" / "engine-api-key"
    key = ensure_api_key(path)
    assert len(key) >= 40 and mode(path) == 0o600 and mode(path.parent) == 0o700
    assert ensure_api_key(path) == key == read_api_key(path)  # made once, then reused
    assert ensure_api_key(tmp_path / "other") != key  # random
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="readable by other users") as err:
        read_api_key(path)
    assert f"chmod 600 {path}" in str(err.value)
    path.chmod(0o600)
    path.write_text("\n")
    with pytest.raises(KeyFileError, match="empty"):
        read_api_key(path)
    with pytest.raises(KeyFileError, match="cannot be read"):
        read_api_key(tmp_path / "missing")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_curve_agent_with_authorized_keys_is_served(
    secure_ctl: ControllerEndpoint, keys: Path
) -> None:
    loop = Loop([secure_ctl], handler=auto_reply())
    _serve_good_agent(secure_ctl, keys, loop)
    for ep in loop.endpoints[1:]:
        ep.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unauthenticated_clients_never_reach_the_application(
    secure_ctl: ControllerEndpoint, keys: Path
) -> None:
    clock = FakeClock()
    # 1. A plain-text DEALER speaking perfect protocol, and 2. a CURVE client whose keypair is
    # not in the allow-list (right server key, so the handshake runs and ZAP must refuse it).
    # 3. A CURVE client that expects another server's key (a MITM-style mismatch).
    rogue_keys = load_client_keys(keys / "rogue", "good")
    real_server = load_server_keys(keys / "k").public
    clients = [
        AgentEndpoint(connect=secure_ctl.endpoint, host_id="plain", config=CFG, clock=clock),
        AgentEndpoint(
            connect=secure_ctl.endpoint,
            host_id="rogue",
            config=CFG,
            clock=clock,
            curve=dataclasses.replace(rogue_keys, server_public=real_server),
        ),
        AgentEndpoint(
            connect=secure_ctl.endpoint, host_id="lost", config=CFG, clock=clock, curve=rogue_keys
        ),
    ]
    for client in clients:
        client.hello({"gpus": [0]})
        client.send_event("exited", {"pid": 1})
    loop = Loop([secure_ctl, *clients])
    end = time.monotonic() + 1.5  # real time for handshakes to be attempted and refused
    while time.monotonic() < end:
        clock.advance(CFG.retry_interval_s)  # make both retry many times
        loop.once(0.01)
    assert loop.log["controller"] == []  # not even a Dropped: nothing got through
    assert secure_ctl.peers() == {}
    for client in clients:
        assert client.stats["resent"] + client.stats["send_failed"] > 3
        assert not loop.of(client.name, Acked)
    # The refused key shows in what the agent reports (and logs as `controller_link`).
    assert "handshake_failed" in [c.what for c in loop.of("rogue", LinkChanged)]
    # The endpoint still serves the authorized agent.
    loop.endpoints, loop.handler = [secure_ctl], auto_reply()
    _serve_good_agent(secure_ctl, keys, loop)
    assert {r.peer for r in loop.of("controller", Received)} == {"good"}
    for ep in (*clients, *loop.endpoints[1:]):
        ep.close()


def test_curve_is_available() -> None:
    assert zmq.has("curve")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_agent_key_speaks_only_for_its_own_host(tmp_path: Path) -> None:
    """Both keys are authorized, each bound to its host id: h-b's key claiming h-a is refused
    (`key_not_bound`, naming the claimed peer), and so is a host id with no key at all."""
    generate_keys(tmp_path, agents=["h-a", "h-b"])
    assert sorted(json.loads((tmp_path / "hosts.json").read_text())) == ["h-a", "h-b"]
    clock = FakeClock()
    with ControllerEndpoint(config=CFG, epoch=1, curve=load_server_keys(tmp_path)) as ctl:
        b_keys = load_client_keys(tmp_path, "h-b")
        impostors = [
            AgentEndpoint(connect=ctl.endpoint, host_id=h, config=CFG, clock=clock, curve=b_keys)
            for h in ("h-a", "h-c")
        ]
        for imp in impostors:
            imp.hello({"gpus": []})
            imp.send_event("exited", {"pid": 1})
        loop = Loop([ctl, *impostors])
        loop.run_until(lambda: {d.peer for d in loop.of("controller", Dropped)} >= {"h-a", "h-c"})
        assert {str(d.reason) for d in loop.of("controller", Dropped)} == {"key_not_bound"}
        assert not loop.of("controller", Received) and ctl.peers() == {}
        for imp in impostors:
            imp.close()
        # h-b speaking for itself is served.
        own = AgentEndpoint(connect=ctl.endpoint, host_id="h-b", config=CFG, epoch=1, curve=b_keys)
        loop = Loop([ctl, own], handler=auto_reply())
        hello = own.hello({})
        loop.run_until(lambda: any(a.msg_id == hello for a in loop.of("h-b", Acked)))
        assert {r.peer for r in loop.of("controller", Received)} == {"h-b"}
        own.close()


def test_server_keys_without_a_host_binding_are_refused(tmp_path: Path) -> None:
    generate_keys(tmp_path, agents=["h-a"])
    (tmp_path / "hosts.json").unlink()
    with pytest.raises(KeyFileError, match="host binding"):
        load_server_keys(tmp_path)
    (tmp_path / "hosts.json").write_text('{"h-a": 3}')
    with pytest.raises(KeyFileError, match="malformed"):
        load_server_keys(tmp_path)


def test_an_api_key_file_that_is_a_link_or_anothers_is_refused(tmp_path: Path) -> None:
    """The engines' key is read from a folder others may reach (`[transport] curve_keys`, a
    cluster's shared folder). Before, a symbolic link planted there was followed: a one-line
    0600 file of the user's (here a token) became the engines' key — handed to SGLang as
    `--api-key`, which every user of the node reads with `ps` — and a 0600 file owned by
    another user (what root reads) was taken as the key, which that user then knows. Now
    both are refused, naming the file and the fix, and the token is not returned."""
    import os

    from ehp_fsm.runtime.keys import ensure_api_key, read_api_key

    token = tmp_path / "token"
    token.write_text("ghp_the_users_own_secret\n")
    token.chmod(0o600)
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    (keys / "engine-api-key").symlink_to(token)
    for read in (ensure_api_key, read_api_key):
        with pytest.raises(KeyFileError, match="symbolic link") as err:
            read(keys / "engine-api-key")
        assert str(token) in str(err.value) and "ghp_" not in str(err.value)
    if os.geteuid() == 0:  # a file of another user's: only root can make one here
        other = keys / "other-key"
        other.write_text("planted-by-another-user\n")
        other.chmod(0o600)
        os.chown(other, 65534, 65534)
        with pytest.raises(KeyFileError, match="owned by another user") as err:
            read_api_key(other)
        assert "uid 65534" in str(err.value)


def test_a_curve_secret_key_file_that_is_a_link_or_anothers_is_refused(tmp_path: Path) -> None:
    """CURVE secret key files may lie in a folder others reach (a cluster's shared
    `curve_keys`). Before, a symbolic link planted there was followed — a keypair file of the
    user's from elsewhere (another cluster's, here) became the key the agent or controller
    authenticates with — and a 0600 file owned by another user (what root reads) was taken,
    whose owner then knows the secret. Now both are refused, naming the file and the fix, as
    the engines' API key is (`read_api_key`)."""
    import os

    from ehp_fsm.runtime.keys import load_keypair

    layout = generate_keys(tmp_path / "k", agents=["good"])
    theirs = generate_keys(tmp_path / "elsewhere", agents=["good"])
    for mine, other, load in (
        (layout.agent_secrets["good"], theirs.agent_secrets["good"], load_keypair),
        (layout.controller_secret, theirs.controller_secret, load_keypair),
    ):
        mine.unlink()
        mine.symlink_to(other)
        with pytest.raises(KeyFileError, match="symbolic link") as err:
            load(mine)
        assert str(other) in str(err.value) and "remove the link" in str(err.value)
    with pytest.raises(KeyFileError, match="symbolic link"):
        load_client_keys(tmp_path / "k", "good")
    with pytest.raises(KeyFileError, match="symbolic link"):
        load_server_keys(tmp_path / "k")
    if os.geteuid() == 0:  # a file of another user's: only root can make one here
        mine = theirs.agent_secrets["good"]
        os.chown(mine, 65534, 65534)
        with pytest.raises(KeyFileError, match="owned by another user") as err:
            load_client_keys(tmp_path / "elsewhere", "good")
        assert "uid 65534" in str(err.value)


def test_an_api_key_or_secret_key_that_is_not_a_regular_file_is_named_so(tmp_path: Path) -> None:
    """A FIFO (or device) where the engines' key or a CURVE secret key belongs is refused as
    what it is, without blocking on the open. Before, the API key's reader read nothing from
    it and said the key was "empty or holds spaces" (its fix, "remove the file: the next run
    writes a fresh one", hid that something else had been put there) and a CURVE key file
    "does not exist"; both private-file readers now share one check (`keys._read_private`)."""
    import os

    from ehp_fsm.runtime.keys import load_keypair, read_api_key

    fifo = tmp_path / "engine-api-key"
    os.mkfifo(fifo, 0o600)
    for read in (read_api_key, load_keypair):
        with pytest.raises(KeyFileError, match="is not a regular file") as err:
            read(fifo)
        assert str(fifo) in str(err.value)
    generate_keys(tmp_path / "k", agents=["good"])
    public = tmp_path / "k" / "controller.key"  # was "does not exist"
    public.unlink()
    os.mkfifo(public, 0o644)
    with pytest.raises(KeyFileError, match="is not a regular file"):
        load_client_keys(tmp_path / "k", "good")
