"""``fairgate keys`` edits a configuration's ``[[key]]`` tables as text (``fairgate.keyfile``): every other
line stays byte for byte, concurrent commands do not lose each other's change, a symlinked configuration is
edited where it points. Found by an outside tester: six concurrent ``keys add`` stored two keys (four printed
keys were lost), a ``revoke`` beside an ``add`` reported "revoked" yet the key stayed, ``revoke`` regrouped
the key tables and moved their comments onto other tables, and an edit replaced a symlink by a copy."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fairgate.gateway.auth import hash_api_key
from tests.conftest import fairgate
from tests.gateway.conftest import write_config


def layout(tmp_path: Path, newline: str = "\n") -> Path:
    """A config whose [[key]] tables are interleaved with other tables, each with its own comments (what
    ``keys add-admin`` then ``keys add`` leave)."""
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    text = path.read_text().split("[[key]]")[0]  # the gateway, upstream and quotas tables
    tables = [
        "# key one: the CI runner",
        "[[key]]",
        'tenant = "alpha"  # alpha!',
        f'hash = "{hash_api_key("fg-one-" + "1" * 30)}"',
        'name = "one"',
        "",
        "# ===== admin section (do not remove this comment) =====",
        "[admin]",
        f'key_hashes = ["{hash_api_key("fg-admin-" + "a" * 30)}"]',
        "",
        "# key two",
        "[[key]]",
        'tenant = "beta"',
        f'hash = "{hash_api_key("fg-two-" + "2" * 30)}"',
        'name = "two"',
        "",
        "# ===== delegation =====",
        "[delegation]",
        "delegates = []",
        "",
        "# key three",
        "[[key]]",
        'tenant = "gamma"',
        f'hash = "{hash_api_key("fg-three-" + "3" * 30)}"',
        'name = "three"',
        "",
    ]
    path.write_bytes((text.rstrip("\n") + "\n\n" + "\n".join(tables)).replace("\n", newline).encode())
    return path


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_revoke_removes_its_table_and_comments_and_nothing_else(tmp_path: Path, newline: str) -> None:
    path = layout(tmp_path, newline)
    before = path.read_bytes().decode()
    done = fairgate("keys", "revoke", "--config", str(path), "--name", "two")
    assert done.returncode == 0, done.stderr
    after = path.read_bytes().decode()
    two = f'# key two{newline}[[key]]{newline}tenant = "beta"{newline}'
    assert two in before and two not in after
    assert "# ===== admin section (do not remove this comment) =====" + newline + "[admin]" in after
    assert "# ===== delegation =====" + newline + "[delegation]" in after
    assert "# key one: the CI runner" + newline + "[[key]]" + newline + 'tenant = "alpha"  # alpha!' in after
    assert (newline == "\r\n") == ("\r\n" in after) and "\n" not in after.replace(newline, "")
    assert [k["name"] for k in tomllib.loads(after)["key"]] == ["one", "three"]
    # Byte for byte: the result is the original less the table's own lines.
    lines = before.split(newline)
    start = lines.index("# key two")
    assert after.split(newline) == lines[:start] + lines[start + 6 :]  # its 5 lines and the blank line after


def test_rotate_sets_the_old_keys_expiry_in_place_and_appends_the_new_one(tmp_path: Path) -> None:
    path = layout(tmp_path)
    before = path.read_text()
    done = fairgate("keys", "rotate", "--config", str(path), "--name", "one", "--grace-hours", "2")
    assert done.returncode == 0, done.stderr
    after = path.read_text()
    assert after.startswith(before.split('name = "one"\n')[0] + 'name = "one"\nexpires = 20')
    keys = tomllib.loads(after)["key"]
    assert [(k["tenant"], k["name"], "expires" in k) for k in keys] == [
        ("alpha", "one", True),
        ("beta", "two", False),
        ("gamma", "three", False),
        ("alpha", "one", False),
    ]
    assert hash_api_key(done.stdout.strip()) == keys[-1]["hash"]
    assert 7190 <= (keys[0]["expires"] - keys[-1]["created"]).total_seconds() <= 7201
    rest = after.split('name = "one"\nexpires = ')[1].split("\n", 1)[1]
    assert before.split('name = "one"\n', 1)[1] in rest  # every line after it as it was


def test_concurrent_key_commands_lose_nothing(tmp_path: Path) -> None:
    path = layout(tmp_path)
    command = [sys.executable, "-m", "fairgate", "keys", "add", "alpha", "--config", str(path)]
    adds = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    revoke = subprocess.Popen(
        [sys.executable, "-m", "fairgate", "keys", "revoke", "--config", str(path), "--name", "three"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    printed = []
    for process in adds:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        printed.append(out.strip())
    _, err = revoke.communicate(timeout=120)
    assert revoke.returncode == 0, err
    stored = {k["hash"] for k in tomllib.loads(path.read_text())["key"]}
    assert {hash_api_key(key) for key in printed} <= stored  # every key printed is stored
    assert all(k.get("name") != "three" for k in tomllib.loads(path.read_text())["key"])  # and the revoke held
    assert len(stored) == 2 + 6


def test_a_symlinked_config_is_edited_where_it_points(tmp_path: Path) -> None:
    real = layout(tmp_path / "real")
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert fairgate("keys", "revoke", "--config", str(link), "--name", "one").returncode == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert [k["name"] for k in tomllib.loads(real.read_text())["key"]] == ["two", "three"]


def test_keys_not_written_as_tables_are_refused_clearly(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path, ["http://127.0.0.1:9"])
    tables = tomllib.loads(path.read_text())["key"]
    inline = ", ".join(
        f'{{tenant = "{k["tenant"]}", hash = "{k["hash"]}", name = "k{i}"}}' for i, k in enumerate(tables)
    )
    path.write_text(f"key = [{inline}]\n" + path.read_text().split("[[key]]")[0])
    before = path.read_text()
    done = fairgate("keys", "revoke", "--config", str(path), "--name", "k0")
    assert done.returncode == 2 and "not all [[key]] tables" in done.stderr and str(path) in done.stderr
    assert "Traceback" not in done.stderr and path.read_text() == before


def test_the_manifests_placeholder_key_and_admin_hash_are_replaced_by_the_commands_its_comment_names(
    tmp_path: Path,
) -> None:
    """Found by a new user: ``keys add`` / ``add-admin`` append, so the manifest's placeholders stayed, and no
    command removed an admin hash. The steps deploy/kubernetes/gateway.yaml names leave only the new ones."""
    import yaml

    from fairgate.gateway.auth import verify_api_key
    from fairgate.gateway.config import load_gateway_config

    manifest = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "gateway.yaml"
    comment = manifest.read_text().split("apiVersion:")[0]
    for step in ("keys add acme", "keys revoke --name example", "keys add-admin", "keys revoke-admin --hash"):
        assert f"fairgate {step}" in comment
    config_map = next(d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "ConfigMap")
    path = tmp_path / "fairgate.toml"
    text = config_map["data"]["fairgate.toml"].replace("/var/lib/fairgate/", f"{tmp_path}/")
    path.write_text(text)
    placeholder_admin = load_gateway_config(path).admin.key_hashes[0]

    tenant_key = fairgate("keys", "add", "acme", "--config", str(path), "--name", "acme-prod")
    assert tenant_key.returncode == 0, tenant_key.stderr
    assert fairgate("keys", "revoke", "--config", str(path), "--name", "example").returncode == 0
    admin_key = fairgate("keys", "add-admin", "--config", str(path))
    assert admin_key.returncode == 0, admin_key.stderr
    listed = fairgate("keys", "list", "--config", str(path)).stdout
    shown = next(line.split()[2] for line in listed.splitlines() if line.startswith("(admin)") and "$1111" in line)
    gone = fairgate("keys", "revoke-admin", "--config", str(path), "--hash", shown)
    assert gone.returncode == 0, gone.stderr
    assert "revoked the admin key sha256$1111111111111111" in gone.stderr

    loaded = load_gateway_config(path)
    assert [(k.tenant, k.name) for k in loaded.keys] == [("acme", "acme-prod")]
    assert verify_api_key(tenant_key.stdout.strip(), loaded.keys[0].hash)
    assert len(loaded.admin.key_hashes) == 1 and verify_api_key(admin_key.stdout.strip(), loaded.admin.key_hashes[0])
    after = path.read_text()
    assert placeholder_admin not in after and "sha256$0000" not in after
    assert "# the emergency journal: per pod (emptyDir)" in after  # the rest of the file as it was
    assert after.split("[quotas.tenants.acme]")[0] == text.split("[quotas.tenants.acme]")[0]
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert audit[-1]["action"] == "admin_key.revoke" and audit[-1]["before"] == {"hash": placeholder_admin[:19]}

    again = fairgate("keys", "revoke-admin", "--config", str(path), "--hash", shown)
    assert again.returncode == 2 and "no admin key hash matches" in again.stderr and path.read_text() == after
    short = fairgate("keys", "revoke-admin", "--config", str(path), "--hash", "sha256$12")
    assert short.returncode == 2 and "at least 12 characters" in short.stderr
    last = loaded.admin.key_hashes[0][:19]  # the one left: removing it would lock the admin API for good
    locked = fairgate("keys", "revoke-admin", "--config", str(path), "--hash", last)
    assert locked.returncode == 2 and "the last admin key" in locked.stderr and path.read_text() == after
