#!/usr/bin/env bash
# Installs the browser that tests/test_browser.py drives: Debian's chromium, because
# `playwright install` downloads from a CDN this machine cannot reach. Idempotent.
set -euo pipefail

chromium="${HVDMAGIC_CHROMIUM:-/usr/bin/chromium}"

say() { printf '[install_browser] %s\n' "$*"; }

if [ -x "$chromium" ]; then
    say "chromium already installed: $chromium"
    exit 0
fi

if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    say "chromium was not found at $chromium, and it can only be installed automatically as root with apt-get."
    say "Install it yourself (Debian/Ubuntu: 'sudo apt-get install -y chromium'),"
    say "or point HVDMAGIC_CHROMIUM at an existing Chromium/Chrome binary."
    say "Without it tests/test_browser.py fails."
    exit 1
fi

say "installing chromium (apt-get install chromium)"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then
    say "apt-get could not install chromium; tests/test_browser.py will fail until it is installed."
    exit 1
fi
if [ ! -x "$chromium" ]; then
    say "apt-get finished, but $chromium is still missing (Ubuntu ships chromium as a snap; install Chrome and set HVDMAGIC_CHROMIUM)."
    exit 1
fi
say "chromium installed: $("$chromium" --version 2>/dev/null || echo "$chromium")"
