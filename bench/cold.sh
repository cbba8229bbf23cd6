#!/usr/bin/env bash
# (helper, sourced) The flags a cold `deltafin bench io|run` gets on this machine, printed by
# `cold_flags` after it empties the page cache where it can (issue 40):
#   Linux: none. Expert reads are O_DIRECT, cold whatever the page cache holds; `bench` also drops
#          the page cache itself when run as root.
#   macOS: no O_DIRECT, and F_NOCACHE still serves pages already cached: it runs `sudo -n purge`
#          (root, or passwordless sudo) and prints `--assume-purged`; where it cannot purge it says
#          so on stderr and prints nothing, and the records say "cold": false.
# Call it right before each cold measurement (after `place`, which writes through the page cache):
#   . bench/cold.sh; deltafin bench io --model M $(cold_flags)
cold_flags() {
  [ "$(uname -s)" = Darwin ] || return 0
  if sudo -n /usr/sbin/purge 2>/dev/null; then
    echo --assume-purged
  else
    echo "bench: macOS serves F_NOCACHE reads from pages already cached; \`sudo -n purge\` failed" \
      "(run as root or with passwordless sudo for cold figures), so these records say \"cold\": false" >&2
  fi
}
