"""Validation of audit messages against the DICOM Audit Message Schema (PS3.15 A.5.1), with
libxml2's RELAX NG validator through lxml: a validator we did not write, for the tests and for
an operator who wants to check what the node sends.

lxml is not a dependency of the node (it is in the ``test`` extra); :func:`validate` says so
when it is missing.

Must not touch: building or sending messages.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).resolve().parent / "schema" / "dicom-audit-message.rng"

_lock = threading.Lock()


def _etree() -> Any:
    try:
        from lxml import etree
    except ImportError as exc:
        raise ImportError(
            "validating audit messages needs lxml, which the node does not depend on: "
            "pip install lxml (it is in segnode's [test] extra)"
        ) from exc
    return etree


@lru_cache(maxsize=1)
def _schema() -> Any:
    etree = _etree()
    return etree.RelaxNG(etree.parse(str(SCHEMA)))


def validate(xml: bytes) -> list[str]:
    """The schema errors of the audit message ``xml`` (UTF-8); empty when it is valid.

    Raises
    ------
    ImportError
        lxml is not installed.
    """
    etree = _etree()
    with _lock:  # one RelaxNG object, whose error log is per validation
        schema = _schema()
        try:
            document = etree.fromstring(xml)
        except etree.XMLSyntaxError as exc:
            return [f"not well-formed XML: {exc}"]
        if schema.validate(document):
            return []
        return [f"line {e.line}: {e.message}" for e in schema.error_log]
