# Sourced by bench/device_*.sh on the lent GPU machine: install each carried wheel folder
# (.whl, .whl_*) into /tmp/site once per machine (a marker file per folder), then put
# /tmp/site and the checkout on PYTHONPATH.
for d in ${WHEEL_DIRS:-.whl .whl_*}; do
    [ -d "$d" ] || continue
    [ -f "/tmp/site/.installed$d" ] && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$d"/*.whl >/dev/null 2>&1 || { echo "install $d failed"; exit 1; }
    touch "/tmp/site/.installed$d"
    echo "installed $d"
done
export PYTHONPATH=/tmp/site:$PWD
