# shellcheck shell=bash
# Sourced by the install scripts: apt-get that waits for a busy dpkg/apt lock instead of failing.
# On a shared host another apt run (unattended-upgrades, a second checkout's CI) may hold the lock for a
# minute or two; `make test` should wait for it, not fail outright.

APT_LOCK_WAIT_S=${APT_LOCK_WAIT_S:-900}

# apt_get ARGS...: like `apt-get -y -qq ARGS`, waiting up to APT_LOCK_WAIT_S seconds for the locks.
# DPkg::Lock::Timeout makes apt itself wait for the dpkg frontend lock (install); `apt-get update` takes the
# lists lock without waiting, so a lock failure there is retried until the same deadline.
apt_get() {
  local deadline=$((SECONDS + APT_LOCK_WAIT_S)) err rc
  err=$(mktemp)
  while :; do
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get -y -qq -o DPkg::Lock::Timeout="$APT_LOCK_WAIT_S" "$@" 2>"$err" || rc=$?
    if [ "$rc" = 0 ]; then
      cat "$err" >&2; rm -f "$err"; return 0
    fi
    if grep -q -E 'Could not get lock|Unable to lock|is another process using it' "$err" && [ "$SECONDS" -lt "$deadline" ]; then
      echo "apt is busy (another apt/dpkg holds its lock); waiting..." >&2
      sleep 5
      continue
    fi
    cat "$err" >&2; rm -f "$err"; return "$rc"
  done
}

# apt_install PACKAGE...: install Debian packages (no recommends), updating the lists once per run.
apt_install() {
  if [ -z "${_KVPILOT_APT_UPDATED:-}" ]; then
    apt_get update
    _KVPILOT_APT_UPDATED=1
  fi
  apt_get install --no-install-recommends "$@" >/dev/null
}

# can_apt: true when this process may install Debian packages (root with apt-get).
can_apt() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1
}
