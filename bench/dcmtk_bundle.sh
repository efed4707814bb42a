#!/usr/bin/env bash
# Pack this machine's DCMTK storescu with the shared libraries it loads, the loader and the
# data dictionary into .dcmtk/dcmtk.tar.xz (about 14 MB), for a machine without DCMTK (the
# lent GPU machine of bench/device_burst.sh). The wrapper runs it through the packed loader,
# so the other machine's C library does not matter.
set -euo pipefail
src=$(command -v storescu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
b=$tmp/dcmtkb
mkdir -p "$b/bin" "$b/lib" "$b/share"
ldd "$src" | awk '/=>/ {print $3}' | xargs -I{} cp -L {} "$b/lib/"
cp -L /lib64/ld-linux-x86-64.so.2 "$b/lib/"
cp "$src" "$b/bin/storescu.real"
dict=$(strings "$b"/lib/libdcmdata.so.* | grep "/dicom.dic" | head -n1 | cut -d: -f1 || true)
cp "$dict" "$(dirname "$dict")/private.dic" "$b/share/"
cat >"$b/bin/storescu" <<'WRAP'
#!/bin/sh
# DCMTK's storescu with the libraries it was built against, through their own loader
here=$(dirname "$(readlink -f "$0")")
export DCMDICTPATH="$here/../share/dicom.dic:$here/../share/private.dic"
exec "$here/../lib/ld-linux-x86-64.so.2" --library-path "$here/../lib" "$here/storescu.real" "$@"
WRAP
chmod +x "$b/bin/storescu"
"$b/bin/storescu" --version | head -1 || true  # head closes the pipe early
mkdir -p .dcmtk
tar cJf .dcmtk/dcmtk.tar.xz -C "$tmp" dcmtkb
ls -la .dcmtk/dcmtk.tar.xz
