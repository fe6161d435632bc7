#!/usr/bin/env bash
# Installs what the test suite needs beyond pip: filled in by the client-harness work.
set -euo pipefail
