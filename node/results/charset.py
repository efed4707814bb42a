"""The Specific Character Set (0008,0005) of the SEG and SR, from that of their source.

The results copy the source's Patient and Study attributes (names, IDs, descriptions) as the
Python strings pydicom decoded them to, and pydicom encodes them again with the results'
character set. The source's value is kept where highdicom accepts it and it can encode every
copied string; otherwise the results are written in UTF-8 (``ISO_IR 192``, PS3.3
C.12.1.1.2), which encodes any string:

* an empty first value followed by others (the default repertoire with code extensions,
  e.g. ``['', 'ISO 2022 IR 87']``, PS3.3 C.12.1.1.2) is written as its defined term
  ``ISO 2022 IR 6``, the one highdicom takes;
* ``ISO_IR 6`` or ``ISO 2022 IR 6`` alone is the default repertoire: no element is written;
* a single ``ISO 2022 IR n`` becomes ``ISO_IR n``, the same character set without code
  extensions (highdicom refuses code extensions for a single value);
* a value highdicom cannot write (an unknown term, or a combination PS3.3 C.12.1.1.2
  forbids) becomes ``ISO_IR 192``;
* so does a value whose repertoire cannot hold a copied string: characters pydicom had to
  replace when decoding (U+FFFD), or bytes above 0x7F read without a declared character
  set (pydicom decodes them as Latin-1; the default repertoire is ISO-IR 6, PS3.5
  6.1.2.1).
"""

from __future__ import annotations

from typing import Any

from highdicom.valuerep import _check_specific_character_set
from pydicom.charset import custom_encoders, python_encoding
from pydicom.dataset import Dataset
from pydicom.multival import MultiValue

UTF8 = "ISO_IR 192"
"""Unicode in UTF-8: the character set of results whose source's cannot be kept."""

_DEFAULT_WITH_EXTENSIONS = "ISO 2022 IR 6"
_DEFAULT = ("", "ISO_IR 6", _DEFAULT_WITH_EXTENSIONS)
_CODE_EXTENSIONS = "ISO 2022 IR "
# The value representations whose values are encoded with the Specific Character Set
# (PS3.5 6.1.2.3).
_TEXT_VRS = frozenset({"SH", "LO", "ST", "LT", "UT", "UC", "PN"})


def result_character_set(source: Dataset) -> str | list[str] | None:
    """The Specific Character Set of results copying strings from ``source``.

    Parameters
    ----------
    source
        The first source image (its headers give the results' Patient and Study modules).

    Returns
    -------
    str | list[str] | None
        A value highdicom accepts for ``specific_character_set``; None for the default
        repertoire (no element). See the module docstring for the rules.
    """
    value = source.get("SpecificCharacterSet")
    terms = [value] if isinstance(value, str) else list(value) if value is not None else []
    charset = _normalised([str(term).strip() for term in terms])
    if charset == UTF8 or _encodes(source, charset):
        return charset
    return UTF8


def _normalised(terms: list[str]) -> str | list[str] | None:
    """``terms`` in the form highdicom writes, or :data:`UTF8` where it cannot."""
    terms = terms[:1] + [term for term in terms[1:] if term]
    if not terms or (len(terms) == 1 and terms[0] in _DEFAULT):
        return None
    if len(terms) == 1:
        term = terms[0]
        if term.startswith(_CODE_EXTENSIONS):
            term = "ISO_IR " + term.removeprefix(_CODE_EXTENSIONS)
        charset: str | list[str] = term
    else:
        charset = [terms[0] or _DEFAULT_WITH_EXTENSIONS, *terms[1:]]
    try:
        _check_specific_character_set(charset)
    except ValueError:  # not a defined term, or not a combination PS3.3 C.12.1.1.2 allows
        return UTF8
    return charset


def _codecs(charset: str | list[str] | None) -> list[str]:
    """The Python codecs pydicom encodes with for ``charset``; ASCII for the default
    repertoire (pydicom's Latin-1 would write bytes the repertoire does not have)."""
    terms = [charset] if isinstance(charset, str) else charset or [""]
    return ["ascii" if term in _DEFAULT else python_encoding.get(term, "") for term in terms]


def _encodable(char: str, codec: str) -> bool:
    encoder = custom_encoders.get(codec)
    try:
        if encoder is not None:
            encoder(char, errors="strict")
        else:
            char.encode(codec)
    except (UnicodeError, LookupError):
        return False
    return True


def _encodes(source: Dataset, charset: str | list[str] | None) -> bool:
    """Whether pydicom encodes every public text value of ``source`` with ``charset``
    without replacing characters (a character may take any of its code extensions)."""
    codecs = _codecs(charset)
    for element in source.iterall():
        if element.tag.is_private or element.VR not in _TEXT_VRS:
            continue
        values: Any = element.value
        for value in values if isinstance(values, MultiValue | list) else [values]:
            if value is None or isinstance(value, bytes):
                continue
            text = str(value)
            if text.isascii():
                continue
            if not all(any(_encodable(c, codec) for codec in codecs) for c in set(text)):
                return False
    return True
