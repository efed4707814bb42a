"""Deflated Explicit VR Little Endian (PS3.5 A.5) for the SEG: the data set deflated in
parallel, and the checks of the deflated stream that need no full inflate.

In that transfer syntax the data set after the File Meta Information is the Explicit VR Little
Endian encoding deflated (RFC 1951, raw: no zlib header or checksum); the file ends on a NUL
byte when the stream has an odd length, as pydicom writes it, so that the data set has an even
length. A BINARY SEG is mostly empty bits, which deflate removes: 117 segments of a
512 x 512 x 300 CT go from about 300 MB to a few (docs/performance.md).

:func:`deflate` compresses a data set in blocks on the threads of
:func:`segnode.node.pipeline.parallel.map_blocks` (zlib releases the GIL), pigz's way: each
block is a raw deflate stream of its own, ended with ``Z_SYNC_FLUSH`` (an empty stored block
``00 00 FF FF`` that ends it on a byte boundary, not marked final) and the last one with
``Z_FINISH``; their concatenation is one valid deflate stream, which any inflater reads from
the start. A block refers back only into itself, so an inflater may also start at any block
boundary: :func:`check_blocks` uses that to check the splicing from the start of every block
and the whole of the short last block, without inflating the rest (the node has the data set
it deflated; zlib's compression of a block is trusted, our joining of blocks is checked).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from segnode.node.pipeline.parallel import map_blocks, threads

#: zlib level: level 1 is about as small as level 3 for SEG frames, at a third of the time
#: of level 6 (docs/performance.md).
LEVEL = 1
#: zlib's memLevel (its hash table size): 4 deflates SEG frames in about 70 % of the time of
#: the default 8, to the same size (docs/performance.md).
MEM_LEVEL = 4
#: Data set bytes per block, at least (a block per thread is enough for speed; smaller blocks
#: cost a little size).
MIN_BLOCK = 4 << 20
#: The last block: this many bytes of the data set's end, deflated on their own, so that the
#: check inflates the end of the stream (the final block) cheaply.
TAIL = 64 << 10
#: Bytes the check inflates at the start of every block.
PROBE = 256
_SYNC_MARK = b"\x00\x00\xff\xff"


@dataclass(frozen=True)
class Deflated:
    """A data set deflated in blocks.

    Attributes
    ----------
    stream
        The deflate stream, padded with a NUL byte to even length.
    blocks
        Per block: (offset in the data set, offset in ``stream``) where it starts.
    length
        Bytes of the data set.
    """

    stream: bytes
    blocks: tuple[tuple[int, int], ...]
    length: int


def deflate(
    data: bytes | bytearray | memoryview,
    *,
    level: int = LEVEL,
    strategy: int = zlib.Z_DEFAULT_STRATEGY,
) -> Deflated:
    """Deflate ``data`` in independent blocks on several threads.

    Parameters
    ----------
    data
        The Explicit VR Little Endian data set.
    level, strategy
        zlib's compression level and strategy (``zlib.Z_RLE`` suits 8-bit label maps).
    """
    view = memoryview(data).cast("B")
    total = len(view)
    body = max(0, total - TAIL)
    parts = max(1, min(2 * threads(), body // MIN_BLOCK))
    size = -(-body // parts) if body else 0
    starts = [*range(0, body, size)] if size else []
    starts.append(body)  # the tail block, always there (empty data: one empty final block)

    def block(first: int, stop: int) -> list[bytes]:
        out = []
        for i in range(first, stop):
            start = starts[i]
            end = starts[i + 1] if i + 1 < len(starts) else total
            compressor = zlib.compressobj(
                level, zlib.DEFLATED, -zlib.MAX_WBITS, MEM_LEVEL, strategy
            )
            last = i == len(starts) - 1
            out.append(
                compressor.compress(view[start:end])
                + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)
            )
        return out

    pieces = [p for found in map_blocks(block, len(starts), 1) for p in found]
    offsets, position = [], 0
    for start, piece in zip(starts, pieces, strict=True):
        offsets.append((start, position))
        position += len(piece)
    if position % 2:
        pieces.append(b"\x00")
    return Deflated(b"".join(pieces), tuple(offsets), total)


def inflate(stream: bytes | bytearray | memoryview) -> bytes:
    """The data set of a deflate ``stream`` (its NUL padding ignored).

    Raises
    ------
    zlib.error
        The stream is not valid deflate data or ends early.
    """
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    data = inflater.decompress(stream)
    if not inflater.eof:
        raise zlib.error("the deflate stream ends before its final block")
    if inflater.unused_data not in (b"", b"\x00"):
        raise zlib.error(f"{len(inflater.unused_data)} bytes follow the deflate stream")
    return data


def check_blocks(
    data: bytes | bytearray | memoryview,
    stream: bytes | bytearray | memoryview,
    blocks: Sequence[tuple[int, int]],
) -> str | None:
    """Whether ``stream`` is ``data`` deflated in ``blocks`` as :func:`deflate` writes it,
    checked without a full inflate; the first disagreement in words, None if none.

    Checks that the blocks start at (0, 0) and ascend in both; every block but the last
    ends with the ``Z_SYNC_FLUSH`` mark; inflating from the start of each block gives the
    data set's bytes at that block's offset (:data:`PROBE` bytes); the last block inflates
    to exactly the data set's end, closes the stream, and only the padding to even length
    follows it.
    """
    data, stream = memoryview(data).cast("B"), memoryview(stream).cast("B")
    if not blocks or tuple(blocks[0]) != (0, 0):
        return "the deflate blocks do not start at the start of the data set"
    if len(stream) % 2:
        return "the deflated data set has an odd length"
    ends: list[tuple[int, int | None]] = [*blocks[1:], (len(data), None)]
    for i, ((plain, packed), (plain_end, packed_end)) in enumerate(zip(blocks, ends, strict=True)):
        last = packed_end is None
        stop = len(stream) if packed_end is None else packed_end
        if not (0 <= plain <= plain_end <= len(data) and packed < stop <= len(stream)):
            return f"deflate block {i} ({plain}, {packed}) is out of order or out of range"
        if not last and stream[stop - 4 : stop] != _SYNC_MARK:
            return f"deflate block {i} does not end with a sync flush"
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            if last:
                found = inflater.decompress(stream[packed:stop])
                complete = inflater.eof and inflater.unused_data in (b"", b"\x00")
                if not complete or found != data[plain:]:
                    return "the last deflate block does not inflate to the data set's end"
            else:
                want = min(PROBE, plain_end - plain)
                found = inflater.decompress(stream[packed:stop], want)
                if found != data[plain : plain + want]:
                    return f"deflate block {i} does not inflate to the data set at {plain}"
        except zlib.error as exc:
            return f"deflate block {i} is not valid deflate data: {exc}"
    return None
