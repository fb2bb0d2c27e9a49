#!/usr/bin/env bash
# Install (or remove) maced as a systemd service running as the dedicated user `mace`.
#
#   sudo tools/install_service.sh [--client-user NAME]... [--cpu-only] [--model-cache DIR] [--no-start]
#   sudo tools/install_service.sh --uninstall [--purge]
#
# Run it from a checkout outside /home and /root (the unit sets ProtectHome=yes), with its
# virtual environment built (`make model` or tools/bootstrap.sh), e.g. in /opt/mace-edge.
set -euo pipefail

PREFIX=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UNIT_DIR=/etc/systemd/system
CONF_DIR=/etc/mace-edge
STATE_DIR=/var/lib/mace-edge
SERVICE_USER=mace
CLIENT_USERS=()
CPU_ONLY=0
START=1
UNINSTALL=0
PURGE=0
MODEL_CACHE=""

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "install_service: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --client-user) CLIENT_USERS+=("$2"); shift 2 ;;
    --cpu-only) CPU_ONLY=1; shift ;;
    --model-cache) MODEL_CACHE="$2"; shift 2 ;;
    --no-start) START=0; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    --purge) PURGE=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown option $1" >&2; usage 2 ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "run as root (sudo)"
command -v systemctl >/dev/null || die "systemctl not found: this machine does not run systemd"

if [ "$UNINSTALL" -eq 1 ]; then
  systemctl disable --now maced.service 2>/dev/null || true
  rm -f "$UNIT_DIR/maced.service"
  rm -rf "$UNIT_DIR/maced.service.d"
  systemctl daemon-reload
  if [ "$PURGE" -eq 1 ]; then
    # Users' feedback and adapters live here: erase only when asked to.
    rm -rf "$STATE_DIR" /var/cache/mace-edge "$CONF_DIR"
    userdel "$SERVICE_USER" 2>/dev/null || true
  fi
  if [ "$PURGE" -eq 1 ]; then echo "maced removed, state purged"; else echo "maced removed; state kept in $STATE_DIR"; fi
  exit 0
fi

case "$PREFIX" in
  /home/*|/root|/root/*|/run/user/*)
    die "$PREFIX is under a home directory, which the service cannot read (ProtectHome=yes); clone into /opt/mace-edge and build its venv there" ;;
esac
[ -x "$PREFIX/.venv/bin/maced" ] || die "$PREFIX/.venv/bin/maced missing: build the venv first (make model)"

# 1. The service user: no login, no home outside the state directory.
if ! id "$SERVICE_USER" >/dev/null 2>&1; then
  useradd --system --user-group --home-dir "$STATE_DIR" --no-create-home \
    --shell /usr/sbin/nologin --comment "MACE-edge daemon" "$SERVICE_USER"
fi
# GPU device nodes (Jetson: video), DRM render nodes, and the jtop socket where they exist.
for group in video render jtop; do
  if getent group "$group" >/dev/null; then usermod -aG "$group" "$SERVICE_USER"; fi
done
# Apps that may talk to the daemon join its group (the socket is 0660 in a 0750 folder).
for user in "${CLIENT_USERS[@]}"; do
  usermod -aG "$SERVICE_USER" "$user"
  echo "added $user to group $SERVICE_USER (takes effect at their next login)"
done

# 2. Files the service reads: the venv must be readable by the service user.
runuser -u "$SERVICE_USER" -- test -r "$PREFIX/.venv/bin/maced" \
  || die "user $SERVICE_USER cannot read $PREFIX; make it world-readable (chmod -R o+rX $PREFIX)"
install -d -m 0755 "$CONF_DIR"
[ -e "$CONF_DIR/maced.toml" ] || install -m 0644 "$PREFIX/systemd/maced.toml" "$CONF_DIR/maced.toml"
sed "s#/opt/mace-edge#$PREFIX#g" "$PREFIX/systemd/maced.service" > "$UNIT_DIR/maced.service"
chmod 0644 "$UNIT_DIR/maced.service"
if [ "$CPU_ONLY" -eq 1 ]; then
  install -d -m 0755 "$UNIT_DIR/maced.service.d"
  install -m 0644 "$PREFIX/systemd/maced.service.d/cpu-only.conf" "$UNIT_DIR/maced.service.d/"
fi
if command -v systemd-analyze >/dev/null; then
  systemd-analyze verify "$UNIT_DIR/maced.service"
fi

# 3. The model, fetched once into the state directory (the service itself never downloads).
install -d -m 0700 -o "$SERVICE_USER" -g "$SERVICE_USER" "$STATE_DIR" "$STATE_DIR/models"
if [ -n "$MODEL_CACHE" ]; then
  cp -a "$MODEL_CACHE" "$STATE_DIR/models/"
  chown -R "$SERVICE_USER:$SERVICE_USER" "$STATE_DIR/models"
fi
runuser -u "$SERVICE_USER" -- env HOME="$STATE_DIR" MACE_STATE_DIR="$STATE_DIR" \
  "$PREFIX/.venv/bin/python" -m edge_runtime.model.fetch --quiet

# 4. Start it and wait for READY (Type=notify: `systemctl start` returns once the model serves).
systemctl daemon-reload
if [ "$START" -eq 1 ]; then
  systemctl enable --now maced.service
  systemctl --no-pager --lines=5 status maced.service || true
  MACE_ENDPOINT=ipc:///run/mace-edge/maced.sock "$PREFIX/.venv/bin/macectl" health || true
  echo "exposure: $(systemd-analyze security maced.service 2>/dev/null | tail -1)"
else
  systemctl enable maced.service
fi
echo "installed: unit $UNIT_DIR/maced.service, config $CONF_DIR/maced.toml, state $STATE_DIR"
