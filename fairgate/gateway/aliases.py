"""Model aliases and pools: the names clients ask for, the pools of upstreams that serve them, in order.

A *pool* is the upstreams that share one fair queue (``[[upstream]].pool``, default its ``model``). A
``[[model]]`` table names an alias and its approved pools::

    [[model]]
    name = "chat"                      # what clients send as "model"
    pools = ["h100", "a10"]            # the first is primary; the others are approved fallbacks, in order
    quota_class = "chat"               # the ledger's model class (default: name)

The request queues in the first pool that has an upstream up: the primary while any of its upstreams is
up, the next approved pool only when none is (not when the primary is merely busy). Whatever pool serves
it, the request is charged to the alias's ``quota_class``: a fallback draws on the same tenant quota. The
body sent upstream carries that upstream's own ``model`` (the engine's model name).

A pool that no ``[[model]]`` lists keeps today's behaviour: its upstreams' ``model`` is a plain model name
clients may send, with itself as quota class. A pool that an alias lists is reachable only through the
aliases that list it, so naming a fallback's engine model directly is an unknown model (404), never a way
to a fresh quota; to expose it under its own name, give that name a ``[[model]]`` (with the alias's
``quota_class`` to share its quota).

An upstream's ``model`` is the engine's own name and may hold ``/`` and ``:`` (vLLM serves a Hugging Face id
such as ``meta-llama/Llama-3.1-8B-Instruct`` by default; hosted providers and Ollama use ``org/name`` and
``name:tag``). Such a name is sent upstream as is, but never used as a name clients send, a pool, a ledger
model class or a metric's ``model``: its pool must be listed by a ``[[model]]``, whose plain name is those.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field

PLAIN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # what clients send, pools, ledger model classes
PoolName = Annotated[str, Field(min_length=1, max_length=200, pattern=PLAIN_NAME)]
# An upstream's ``model``: the engine's own name (see module docstring); no spaces, control characters, or
# a leading "/" or ":".
EngineModelName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]


class ModelConfig(BaseModel):
    """One ``[[model]]``: an alias clients send, its pools (primary first) and its quota class."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: PoolName
    pools: Annotated[list[PoolName], Field(min_length=1, max_length=100)]
    quota_class: PoolName | None = None


class PooledUpstream(Protocol):
    """What this module reads of an ``[[upstream]]``."""

    @property
    def model(self) -> str: ...

    @property
    def pool_name(self) -> str: ...


@dataclass(frozen=True)
class ServedModel:
    """A model name clients may send.

    Attributes:
        name: the name (an alias, or a plain upstream model).
        pools: the pools that may serve it, primary first.
        quota_class: the ledger's model class its requests are reserved and charged in.
        alias: declared by a ``[[model]]`` (else a plain model).
    """

    name: str
    pools: tuple[str, ...]
    quota_class: str
    alias: bool


def served_models(models: Sequence[ModelConfig], upstreams: Sequence[PooledUpstream]) -> dict[str, ServedModel]:
    """Every model name clients may send: the aliases in file order, then the plain models (an upstream
    ``model`` whose pool no alias lists; its pools in file order). Assumes ``check`` found no problem."""
    served = {m.name: ServedModel(m.name, tuple(m.pools), m.quota_class or m.name, True) for m in models}
    listed = {pool for m in models for pool in m.pools}
    plain: dict[str, list[str]] = {}
    for upstream in upstreams:
        pools = plain.setdefault(upstream.model, []) if upstream.pool_name not in listed else None
        if pools is not None and upstream.pool_name not in pools:
            pools.append(upstream.pool_name)
    for name, pools in plain.items():
        if pools:
            served.setdefault(name, ServedModel(name, tuple(pools), name, False))
    return served


def check(models: Sequence[ModelConfig], upstreams: Sequence[PooledUpstream]) -> str | None:
    """The first problem of the ``[[model]]`` tables against the upstreams' pools, as ``<key>: <problem>``
    (e.g. ``model[1].pools[0]: no upstream has pool "x"``); None when there is none."""
    listed = {pool for m in models for pool in m.pools}
    pool_model: dict[str, tuple[int, str]] = {}  # unlisted pool -> (first upstream index, its model)
    plain: dict[str, int] = {}  # plain model name -> index of its first upstream
    for i, upstream in enumerate(upstreams):
        if upstream.pool_name in listed:
            continue
        if re.match(PLAIN_NAME, upstream.model) is None:
            return (
                f'upstream[{i}].model: "{upstream.model}" is the engine\'s name, sent to it as is; clients and the '
                'ledger need a plain name (letters, digits, ".", "_", "-"): set this upstream\'s pool and list it '
                "in a [[model]], whose name clients send"
            )
        first = pool_model.setdefault(upstream.pool_name, (i, upstream.model))
        if first[1] != upstream.model:  # a plain model's request could land on another model's engine
            return (
                f'upstream[{i}].pool: pool "{upstream.pool_name}" also holds upstream[{first[0]}] of model '
                f'"{first[1]}"; a pool of several models must be listed by a [[model]]'
            )
        plain.setdefault(upstream.model, i)
    pools = {u.pool_name for u in upstreams}
    names: dict[str, int] = {}
    for i, model in enumerate(models):
        if model.name in names:
            return f'model[{i}].name: "{model.name}" is also model[{names[model.name]}]\'s name'
        names[model.name] = i
        if model.name in plain:
            return (
                f'model[{i}].name: "{model.name}" is also the model of upstream[{plain[model.name]}], whose pool '
                "no [[model]] lists; list that pool in this model's pools, or rename one of them"
            )
        for j, pool in enumerate(model.pools):
            if pool not in pools:
                return f'model[{i}].pools[{j}]: no upstream has pool "{pool}"'
            if pool in model.pools[:j]:
                return f'model[{i}].pools[{j}]: pool "{pool}" is listed twice'
    return None


__all__ = [
    "PLAIN_NAME",
    "EngineModelName",
    "ModelConfig",
    "PoolName",
    "PooledUpstream",
    "ServedModel",
    "check",
    "served_models",
]
