"""A sqlite URL names a file and nothing else: a query or fragment is refused, not folded into the name; a
ledger URL that is not text at all is a ``ValueError`` like any other bad URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairgate.ledger import connect, quotas_from_dict
from fairgate.ledger.schemes import backend_for


@pytest.mark.parametrize("tail", ["?foo=1", "?timeout=5", "#x"])
async def test_a_sqlite_url_with_parameters_is_refused(tmp_path: Path, tail: str) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db{tail}"
    with pytest.raises(ValueError, match="takes no parameters"):
        backend_for(url).check_url(url)
    with pytest.raises(ValueError, match="takes no parameters"):
        await connect(url, quotas_from_dict({"tenants": {"a": {}}}))
    assert list(tmp_path.iterdir()) == []  # no file made under any name


async def test_a_plain_sqlite_url_opens_its_file(tmp_path: Path) -> None:
    async with await connect(f"sqlite:///{tmp_path}/ledger.db", quotas_from_dict({"tenants": {"a": {}}})):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.db"]


@pytest.mark.parametrize("url", [5, None, b"sqlite:///x.db"])
async def test_a_url_that_is_not_text_is_a_value_error(url: object) -> None:
    with pytest.raises(ValueError, match="must be a string"):
        await connect(url, quotas_from_dict({"tenants": {"a": {}}}))  # type: ignore[arg-type]
