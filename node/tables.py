"""The shape of ``config.toml``'s tables: the checks every section's parser makes first.

This module owns three checks, each raising :class:`~segnode.node.errors.ConfigError` that
names the key: a top-level table (:func:`section`, ``[node]``), an array of tables
(:func:`array_of_tables`, ``[[rules]]``) and the keys a table may hold (:func:`check_keys`).
:mod:`segnode.node.config.parse`, :mod:`segnode.node.routing.rules` and
:mod:`segnode.node.routing.destinations` use them; it imports nothing of the node but its
errors, so that those do not import each other to share them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from segnode.node.errors import ConfigError


def check_keys(table: Mapping[str, Any], known: Collection[str], where: str) -> None:
    """Refuse a key of ``table`` outside ``known``.

    Parameters
    ----------
    table
        The table's values.
    known
        The keys it may hold.
    where
        How the message begins: the table's key and a colon (``"rules[0]:"``), or the
        table's header (``"[node]"``).

    Raises
    ------
    ConfigError
        Listing the unknown keys.
    """
    unknown = set(table) - set(known)
    if unknown:
        raise ConfigError(f"{where} unknown key(s): {', '.join(sorted(unknown))}")


def section(raw: Mapping[str, Any], name: str, known: Collection[str]) -> dict[str, Any]:
    """The top-level table ``[name]`` of ``raw`` (empty when absent), its keys among ``known``.

    Raises
    ------
    ConfigError
        ``name`` is not a table or holds an unknown key.
    """
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    check_keys(table, known, f"[{name}]")
    return table


def array_of_tables(
    value: Any, key: str, known: Collection[str], what: str = "a table"
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The tables of the array of tables ``[[key]]``, each with its key (``key[i]``).

    Parameters
    ----------
    value
        The array's value as TOML gave it.
    key
        The array's key (``"rules"``, ``"node.peers"``).
    known
        The keys each table may hold.
    what
        What each item must be, for the message (``"a table with ae_title ..."``).

    Raises
    ------
    ConfigError
        ``value`` is not an array, or one of its items is not a table or holds an unknown
        key (raised as the iteration reaches it).
    """
    if not isinstance(value, list):
        raise ConfigError(f"{key}: must be an array of tables ([[{key}]])")
    for i, table in enumerate(value):
        item = f"{key}[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{item}: must be {what}")
        check_keys(table, known, f"{item}:")
        yield item, table
