"""Where the GIL went: a summary of ``py-spy record --gil --threads --format raw`` output
(``python -m bench.pyspy_summary FILE``), as bench.burst's ``--profile`` writes it.

Each line of the raw format is a collapsed stack (``frame;frame;...``, the thread first with
``--threads``) and its sample count. Printed: the share of the samples per thread kind (the
thread name less its number), and per thread kind the functions of this project (or the
library frame beneath them) that held the GIL longest, by their own samples and below them.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

OURS = re.compile(r"(segnode|/node/|/engines/|/storage/)")


def thread_kind(frame: str) -> str:
    """``thread (22803): segnode-prepare_0`` -> ``segnode-prepare``."""
    name = re.sub(r"^(thread|process) \([^)]*\):?\s*", "", frame).strip("\"' ")
    name = re.sub(r"0x[0-9a-f]+", "", name)
    return re.sub(r"[-_ ]?\d+\b", "", name).strip() or "main"


def summarise(path: Path, top: int = 12) -> str:
    per_thread: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        kind = thread_kind(frames[0])
        per_thread[kind] += n
        total += n
        seen = set()
        for frame in frames[1:]:
            if OURS.search(frame):
                short = frame.split(" (")[0] + " (" + frame.split("/")[-1]
                if short not in seen:
                    inclusive[kind][short] += n
                    seen.add(short)
    out = [f"{path.name}: {total} samples holding the GIL"]
    for kind, n in per_thread.most_common():
        out.append(f"  {100 * n / total:5.1f} %  {kind}")
        for frame, k in inclusive[kind].most_common(top):
            out.append(f"           {100 * k / total:5.1f} %  {frame}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    for f in args.files:
        print(summarise(f, args.top))


if __name__ == "__main__":
    main()
